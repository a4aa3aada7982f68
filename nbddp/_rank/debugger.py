"""pdb on a rank, with the notebook for terminal: ``breakpoint()``, ``pdb.set_trace()``,
and post-mortem at the frame where the user's code raised.

The rank's pdb writes into a buffer; when it wants a line, the rank sends what pdb wrote
(ending in its prompt) to the kernel and waits: the notebook asks the user, as
``input()`` does, and sends the line back. Where nobody can answer (a run nobody waits
for, a frontend without input, a SLURM job), the kernel says why and the rank goes on
as if told ``c``. ``PYTHONBREAKPOINT`` still rules: ``0`` turns ``breakpoint()`` off,
any other value names the hook to use instead.

Post-mortem (``%%ddp --pdb``) opens pdb on the traceback of the exception, before the
rank reports its failure (so before the kernel stops the ranks). A session's rank keeps
its last failure until its next run, for ``%ddp_debug``.
"""

from __future__ import annotations

import os
import pdb
import sys
from collections.abc import Callable
from types import FrameType, TracebackType
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
            print(f"nbddp: pdb on rank {self._rank} skipped: {answer.reason}", flush=True)
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


class Debugging:
    """This rank's pdb: its ``breakpoint()`` hook, post-mortem, and the last failure a
    session's rank keeps for ``%ddp_debug``."""

    def __init__(self, rank: int, ask: Ask, send: Callable[[Any], None]) -> None:
        self.rank, self._ask, self._send = rank, ask, send
        self.last_failure: tuple[BaseException, TracebackType] | None = None

    def install(self) -> None:
        """Route this rank's ``breakpoint()`` and ``pdb.set_trace()`` to the notebook."""

        def breakpointhook(*args: Any, **kwargs: Any) -> Any:
            if os.environ.get("PYTHONBREAKPOINT"):  # "0": off; else the user's own hook
                return sys.__breakpointhook__(*args, **kwargs)
            self._trace(sys._getframe(1))
            return None

        def set_trace(*, header: str | None = None, **_: Any) -> None:
            self._trace(sys._getframe(1), header)

        sys.breakpointhook = breakpointhook
        pdb.set_trace = set_trace

    def _trace(self, frame: FrameType | None, header: str | None = None) -> None:
        debugger = RankPdb(self.rank, self._ask, self._send)
        if header is not None:
            debugger.message(header)
        debugger.set_trace(frame)

    def post_mortem(self, exc: BaseException, traceback: TracebackType) -> None:
        """pdb at the innermost frame of ``traceback`` (the user's part of ``exc``'s),
        until the user lets it go (``q`` or ``c``), or nobody can answer."""
        debugger = RankPdb(self.rank, self._ask, self._send)
        debugger.message(f"nbddp: rank {self.rank} raised {type(exc).__name__}: {exc}\n"
                         "post-mortem at the failing frame: p NAME, up, down, where; "
                         "q ends it")
        debugger.reset()
        debugger.interaction(None, traceback)

    def keep(self, exc: BaseException, traceback: TracebackType | None) -> None:
        """Keep a session run's failure for ``%ddp_debug`` (until the next run)."""
        self.last_failure = (exc, traceback) if traceback is not None else None


DEBUGGING: Debugging | None = None
"""This rank's, once the worker installed it: the rank loop and ``debug_last_failure``
(which runs as a payload) both use it."""


def install(rank: int, ask: Ask, send: Callable[[Any], None]) -> None:
    """The rank's pdb (``DEBUGGING``), with ``breakpoint()`` and ``pdb.set_trace()``
    routed to the notebook."""
    global DEBUGGING
    DEBUGGING = Debugging(rank, ask, send)
    DEBUGGING.install()


def debug_last_failure() -> bool:
    """``%ddp_debug``'s run, on every rank of a session: post-mortem on the failure this
    rank kept from the last run, if any (then forgotten); whether there was one."""
    if DEBUGGING is None or DEBUGGING.last_failure is None:
        return False
    exc, traceback = DEBUGGING.last_failure
    DEBUGGING.last_failure = None
    DEBUGGING.post_mortem(exc, traceback)
    return True


debug_last_failure.keeps_last_failure = True  # type: ignore[attr-defined]
"""The run that starts with it does not forget the last failure first."""
