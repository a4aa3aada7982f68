"""The notebook's side of pdb on the ranks: one prompt for every rank stopped in pdb.

Prompts arrive on the supervisor's thread, but only the thread waiting in
``Job.result()`` (in a notebook, the cell's own) can ask the frontend for input, so
they wait there. Ranks that stop together are asked together, as ipyparallel asks its
engines: ``[ranks 0,1] (Pdb) p x`` goes to every rank at a prompt, ``@1 p x`` (or
``@0,2 ...``) to those named, and each answer comes back labelled with its rank; ``c``
lets them all go on. A rank alone at its prompt is asked as ``[rank 1] (Pdb) ``, its
answers unlabelled, as pdb prints them. Where nobody waits in ``result()`` (a
``wait=False`` run), or the frontend takes no input, the ranks are told why and go on.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..._errors import name_cells
from ..._wire.messages import DebugInput, DebugPrompt

NOBODY_WAITS = ("no cell waits for this run (wait=False), so nothing can take pdb's "
                "input; call job.result() before the ranks reach a breakpoint")
NO_INPUT = ("this frontend takes no input (e.g. a notebook run by nbclient or nbval, or "
            "stdin captured)")
INTERRUPTED = "the cell was interrupted"
GATHER = 0.2
"""Seconds without a new rank stopping before the user is asked: ranks that reach a
breakpoint together get one prompt."""
ANSWER_WAIT = 2.0
"""Seconds the ranks told a line have to answer it before the user is asked again (their
answers then come together); a rank that takes longer (stepping over a collective that
waits for a stopped rank) answers with a later prompt."""
SERVER_GRACE = 1.0
"""Seconds a prompt waits for a thread to serve it before the rank is told nobody will:
the cell that submitted the run may not be waiting in ``result()`` yet (``%ddp_debug``'s
ranks ask at once)."""
_TARGETS = re.compile(r"^@(\d+(?:\s*,\s*\d+)*)\s*(.*)$", re.S)


class Debugger:
    """Prompts from the ranks' pdb, and the one thread that may answer them."""

    def __init__(self, send: Callable[[int, Any], object], note: Callable[[str], None]) -> None:
        self._send, self._note = send, note
        self._prompts: queue.SimpleQueue[DebugPrompt] = queue.SimpleQueue()
        self._at_prompt: dict[int, DebugPrompt] = {}  # ranks that wait for a line
        self._told: dict[int, float] = {}  # ranks given a line, not yet answered: when
        self._last_stop = 0.0  # when a rank last stopped (not: answered a line)
        self.serving = threading.Event()
        """Set while a thread waits in ``Job.result()`` and serves prompts."""
        self._lock = threading.Lock()  # a prompt is queued for a server, or refused

    def prompt(self, prompt: DebugPrompt) -> None:
        """A rank's pdb wants a line (called on the supervisor's thread)."""
        self.serving.wait(SERVER_GRACE)
        with self._lock:
            if self.serving.is_set():
                self._prompts.put(prompt)
                return
        self._refuse(prompt, NOBODY_WAITS)

    def done(self, rank: int) -> None:
        """The rank's pdb let its code go on (or the rank ended): nothing to wait for."""
        with self._lock:
            self._told.pop(rank, None)
            self._at_prompt.pop(rank, None)

    def done_all(self, ranks: Iterable[int]) -> None:
        """``done`` for each of ``ranks`` (a node's, that ended together)."""
        with self._lock:
            if self._told or self._at_prompt:
                for rank in ranks:
                    self._told.pop(rank, None)
                    self._at_prompt.pop(rank, None)

    def _collect(self) -> None:
        while True:
            try:
                prompt = self._prompts.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                if self._told.pop(prompt.rank, None) is None:  # a stop, not an answer
                    self._last_stop = time.monotonic()
                self._at_prompt[prompt.rank] = prompt

    def serve(self) -> None:
        """Ask the user for a line for the ranks at a prompt, once they are all there,
        and send it to them (the waiting thread)."""
        self._collect()
        with self._lock:
            ready, told = dict(self._at_prompt), dict(self._told)
        now = time.monotonic()
        if not ready or now - self._last_stop < GATHER or any(
                now - since < ANSWER_WAIT for since in told.values()):
            return
        ranks = sorted(ready)
        self._show(ready)
        label = f"[rank {ranks[0]}]" if len(ranks) == 1 else \
            f"[ranks {','.join(map(str, ranks))}]"
        pdb_prompt = ready[ranks[0]].text.rpartition("\n")[2]
        try:
            line = input(f"{label} {pdb_prompt}")
        except (EOFError, OSError, NotImplementedError):  # IPython: StdinNotImplementedError
            for prompt in ready.values():
                self._refuse(prompt, NO_INPUT)
            return
        targets, command = _addressed(line, ranks)
        if targets is None:
            print(f"nbddp: {command}", flush=True)
            return
        self._tell(targets, command)

    def _show(self, ready: dict[int, DebugPrompt]) -> None:
        """What each rank's pdb printed since its last prompt (labelled when several
        ranks are asked together), once."""
        several = len(ready) > 1
        for rank, prompt in sorted(ready.items()):
            said = prompt.text.rpartition("\n")[0]
            if said:
                text = name_cells(said)
                if several:
                    text = "\n".join(f"[rank {rank}] {line}" for line in text.split("\n"))
                print(text, flush=True)
            with self._lock:
                if self._at_prompt.get(rank) is prompt:
                    self._at_prompt[rank] = DebugPrompt(rank, prompt.text.rpartition("\n")[2])

    def _tell(self, ranks: list[int], line: str) -> None:
        with self._lock:
            for rank in ranks:
                self._at_prompt.pop(rank, None)
                self._told[rank] = time.monotonic()
        for rank in ranks:
            self._send(rank, DebugInput(line))

    def stop_serving(self, reason: str = NOBODY_WAITS) -> None:
        """No thread waits any more: tell every rank still waiting for a line."""
        with self._lock:
            self.serving.clear()
        self._collect()
        with self._lock:
            waiting, self._at_prompt, self._told = list(self._at_prompt.values()), {}, {}
        for prompt in waiting:
            self._refuse(prompt, reason)

    def _refuse(self, prompt: DebugPrompt, reason: str) -> None:
        self.done(prompt.rank)
        self._send(prompt.rank, DebugInput(None, reason))
        self._note(f"nbddp: pdb on rank {prompt.rank} skipped: {reason}\n")


def _addressed(line: str, ranks: list[int]) -> tuple[list[int] | None, str]:
    """The ranks a line is for and the command: ``@1,2 p x`` names them, otherwise it is
    for every rank at a prompt. (None and why, if it names a rank not at a prompt.)"""
    match = _TARGETS.match(line.strip())
    if match is None:
        return ranks, line
    named = sorted({int(part) for part in match.group(1).split(",")})
    absent = [rank for rank in named if rank not in ranks]
    if absent:
        return None, (f"rank {', '.join(map(str, absent))} is not at a pdb prompt; these "
                      f"are: {', '.join(map(str, ranks))}")
    return named, match.group(2)
