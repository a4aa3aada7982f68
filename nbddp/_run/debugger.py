"""The notebook's side of pdb on a rank: ask the user for each line a rank's pdb wants.

Prompts arrive on the supervisor's thread, but only the thread waiting in
``Job.result()`` (in a notebook, the cell's own) can ask the frontend for input, so
they wait there. One rank is served at a time, until its pdb lets the code go on; other
ranks' prompts wait their turn, and each prompt names its rank. Where nobody waits in
``result()`` (a ``wait=False`` run), or the frontend takes no input, the rank is told
why and goes on.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from .._errors import name_cells
from .._wire.messages import DebugInput, DebugPrompt

NOBODY_WAITS = ("no cell waits for this run (wait=False), so nothing can take pdb's "
                "input; call job.result() before the ranks reach a breakpoint")
NO_INPUT = ("this frontend takes no input (e.g. a notebook run by nbclient or nbval, or "
            "stdin captured)")


class Debugger:
    """Prompts from the ranks' pdb, and the one thread that may answer them."""

    def __init__(self, send: Callable[[int, Any], object], note: Callable[[str], None]) -> None:
        self._send, self._note = send, note
        self._prompts: queue.Queue[DebugPrompt] = queue.Queue()
        self._waiting: list[DebugPrompt] = []
        self._current: int | None = None
        self.serving = threading.Event()
        """Set while a thread waits in ``Job.result()`` and serves prompts."""
        self._lock = threading.Lock()  # a prompt is queued for a server, or refused

    def prompt(self, prompt: DebugPrompt) -> None:
        """A rank's pdb wants a line (called on the supervisor's thread)."""
        with self._lock:
            if self.serving.is_set():
                self._prompts.put(prompt)
                return
        self._refuse(prompt, NOBODY_WAITS)

    def done(self, rank: int) -> None:
        """The rank's pdb let its code go on: the next rank may be served."""
        if self._current == rank:
            self._current = None

    def _collect(self) -> None:
        while True:
            try:
                self._waiting.append(self._prompts.get_nowait())
            except queue.Empty:
                return

    def serve(self) -> None:
        """Answer the prompt whose turn it is, asking the user (the waiting thread)."""
        self._collect()
        turn = next((p for p in self._waiting if p.rank == self._current), None)
        if turn is None and self._current is None and self._waiting:
            turn = self._waiting[0]
        if turn is None:
            return
        self._waiting.remove(turn)
        self._current = turn.rank
        said, _, prompt = turn.text.rpartition("\n")
        if said:
            print(name_cells(said), flush=True)
        try:
            line = input(f"[rank {turn.rank}] {prompt}")
        except (EOFError, OSError, NotImplementedError):  # IPython: StdinNotImplementedError
            self._refuse(turn, NO_INPUT)
            return
        self._send(turn.rank, DebugInput(line))

    def stop_serving(self) -> None:
        """No thread waits any more: tell every rank still waiting for a line."""
        with self._lock:
            self.serving.clear()
            self._collect()
        for prompt in self._waiting:
            self._refuse(prompt, NOBODY_WAITS)
        self._waiting.clear()
        self._current = None

    def _refuse(self, prompt: DebugPrompt, reason: str) -> None:
        self.done(prompt.rank)
        self._send(prompt.rank, DebugInput(None, reason))
        self._note(f"nbddp: pdb on rank {prompt.rank} skipped: {reason}\n")
