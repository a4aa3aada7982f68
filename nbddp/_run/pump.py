"""The one loop over a rank group's events: pull, drop copies and stale ones, dispatch.

A rank numbers its messages and may send each on two links (a socket and a mailbox
file); what came through the other link first is a copy. A message of an attempt that
torchrun restarted, or of a run of the job that SLURM requeued, is stale. Each message
that is neither goes to the handlers registered for its type, in the order they were
registered: the supervisor's first, then the backend's and the session's. Every wait of
a run (its whole course, a failed attempt's last reports, a session's ranks coming back
to rest, the events left at its end) is this one loop with its own end.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

from .._wire.messages import Disconnected, Sequenced

INTERVAL = 0.05
"""How long one turn waits for an event."""

Handler = Callable[[Any], None]
Numbered = Sequenced | Disconnected
"""A rank's message as it came, with the attempt and the requeue that sent it."""


class Pump:
    """Reads ``events`` for one run; ``current()`` is the (requeue, attempt) it follows."""

    def __init__(self, events: queue.SimpleQueue[Any],
                 current: Callable[[], tuple[int, int]]) -> None:
        self._events, self._current = events, current
        self._handlers: dict[type, list[Handler]] = {}
        self._arrivals: list[Callable[[Numbered], None]] = []
        self._next_seq: dict[tuple[int, int, int], int] = {}
        """Per rank, requeue and attempt: the next message number expected."""

    def on(self, kind: type, handler: Handler) -> None:
        """Call ``handler`` with every new message of type ``kind``."""
        self._handlers.setdefault(kind, []).append(handler)

    def on_arrival(self, hook: Callable[[Numbered], None]) -> None:
        """Call ``hook`` with every rank message as it arrives, copies and stale ones too,
        before they are dropped (how a backend notices its ranks' next run)."""
        self._arrivals.append(hook)

    def _pull(self, timeout: float | None) -> Any:
        """The next event, or None (nothing came, or a copy or a stale message came)."""
        try:
            event = self._events.get(timeout=timeout) if timeout else self._events.get_nowait()
        except queue.Empty:
            return None
        if isinstance(event, (Sequenced, Disconnected)):
            for hook in self._arrivals:
                hook(event)
            if (event.requeue, event.attempt) < self._current():
                return None  # from an attempt that failed or a run SLURM requeued
        if isinstance(event, Sequenced):
            key = (event.rank, event.requeue, event.attempt)
            if event.seq < self._next_seq.get(key, 0):
                return None  # it came through the rank's other link first
            self._next_seq[key] = event.seq + 1
            return event.message
        return event

    def dispatch(self, event: Any) -> None:
        for handler in self._handlers.get(type(event), ()):
            handler(event)

    def run(self, until: Callable[[], bool], seconds: float | None = None, *,
            gate: Callable[[], bool] | None = None, then: Handler | None = None,
            turn: Callable[[], None] | None = None) -> None:
        """Pull and dispatch events until ``until()`` is true or ``seconds`` have passed.

        ``gate()``, if given, is asked between pulling an event and dispatching it: once
        it is false the wait ends, and that event is not dispatched (a cancelled run takes
        in nothing more). ``then(event)`` follows each dispatched event, ``turn()`` each
        turn that did not end the wait.
        """
        deadline = None if seconds is None else time.monotonic() + seconds
        while not until() and (deadline is None or time.monotonic() < deadline):
            event = self._pull(INTERVAL)
            if gate is not None and not gate():
                return
            if event is not None:
                self.dispatch(event)
                if then is not None:
                    then(event)
            if turn is not None and not until():
                turn()

    def drain(self) -> None:
        """Dispatch every event already queued."""
        self.run(self._events.empty)
