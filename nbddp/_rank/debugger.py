"""``breakpoint()`` and ``pdb.set_trace()`` on a rank: pdb, with the notebook for terminal.

The rank's pdb writes into a buffer; when it wants a line, the rank sends what pdb wrote
(ending in its prompt) to the kernel and waits: the notebook asks the user, as
``input()`` does, and sends the line back. Where nobody can answer (a run nobody waits
for, a frontend without input, a SLURM job), the kernel says why and the rank goes on
as if told ``c``. ``PYTHONBREAKPOINT`` still rules: ``0`` turns ``breakpoint()`` off,
any other value names the hook to use instead.
"""

from __future__ import annotations

import os
import pdb
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from .._wire.messages import DebugDone, DebugInput, DebugPrompt

Ask = Callable[[DebugPrompt], DebugInput]


class _Terminal:
    """pdb's stdin and stdout: what it writes waits for its next question."""

    def __init__(self, rank: int, ask: Ask) -> None:
        self._rank, self._ask = rank, ask
        self._written: list[str] = []

    def write(self, text: str) -> int:
        self._written.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        text = "".join(self._written)
        self._written.clear()
        answer = self._ask(DebugPrompt(self._rank, text))
        if answer.line is None:  # nobody can answer: go on, and say why in the rank's log
            print(f"nbddp: breakpoint() on rank {self._rank} skipped: {answer.reason}",
                  flush=True)
            return "continue\n"
        return answer.line + "\n"


class RankPdb(pdb.Pdb):
    """pdb on a rank; tells the kernel when it lets the code go on, so that the next
    rank waiting at a breakpoint may be served."""

    def __init__(self, rank: int, ask: Ask, send: Callable[[Any], None]) -> None:
        terminal = _Terminal(rank, ask)
        super().__init__(stdin=terminal, stdout=terminal,  # type: ignore[arg-type]
                         skip=["nbddp._*"])  # stepping out of the user's code ends in it
        self.use_rawinput = False
        self._rank, self._send = rank, send

    def dispatch_return(self, frame: FrameType, arg: Any) -> Any:
        """Once the user's code returns to nbddp, debugging is over: go on untraced
        (stepping on would walk through nbddp's and torch's own frames)."""
        result = super().dispatch_return(frame, arg)
        caller = frame.f_back
        if caller is not None and caller.f_globals.get("__name__", "").startswith("nbddp."):
            self.set_continue()
            return None
        return result

    def set_continue(self) -> None:
        super().set_continue()
        self._send(DebugDone(self._rank))

    def set_quit(self) -> None:
        super().set_quit()
        self._send(DebugDone(self._rank))


def install(rank: int, ask: Ask, send: Callable[[Any], None]) -> None:
    """Route this rank's ``breakpoint()`` and ``pdb.set_trace()`` to the notebook."""

    def debug(frame: FrameType | None, header: str | None = None) -> None:
        debugger = RankPdb(rank, ask, send)
        if header is not None:
            debugger.message(header)
        debugger.set_trace(frame)

    def breakpointhook(*args: Any, **kwargs: Any) -> Any:
        if os.environ.get("PYTHONBREAKPOINT"):  # "0": off; else the user's own hook
            return sys.__breakpointhook__(*args, **kwargs)
        debug(sys._getframe(1))
        return None

    def set_trace(*, header: str | None = None, **_: Any) -> None:
        debug(sys._getframe(1), header)

    sys.breakpointhook = breakpointhook
    pdb.set_trace = set_trace
