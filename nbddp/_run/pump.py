"""The one loop over a rank group's events: pull, drop copies and stale ones, dispatch.

A rank numbers its messages and may send each on two links (a socket and a mailbox
file); what came through the other link first is a copy. A message of an attempt that
torchrun restarted, or of a run of the job that SLURM requeued, is stale. One of a newer
attempt than the one followed is held until it is followed: torchrun's next attempt can
report before the failed attempt's last reports are gathered, and its results belong to
it. Each message that is none of these goes to the handlers registered for its type, in
the order they were registered: the supervisor's first, then the backend's and the
session's. Every wait of a run (its whole course, a failed attempt's last reports, a
session's ranks coming back to rest, the events left at its end) is this one loop with
its own end.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .._wire.messages import Disconnected, Sequenced
from .._wire.relay_messages import NodeMetrics, RanksFinished

INTERVAL = 0.05
"""How long one turn waits for an event."""

Handler = Callable[[Any], None]
Numbered = Sequenced | Disconnected | RanksFinished | NodeMetrics
"""A rank's message (or a node's relay's, for many) as it came, with the attempt and
the requeue that sent it."""
_NUMBERED = (Sequenced, Disconnected, RanksFinished, NodeMetrics)


def _no_attempt() -> tuple[int, int]:
    """(A closed pump's) No attempt is followed: every rank message is stale."""
    return (2**62, 2**62)


class Pump:
    """Reads ``events`` for one run; ``current()`` is the (requeue, attempt) it follows."""

    def __init__(self, events: queue.SimpleQueue[Any],
                 current: Callable[[], tuple[int, int]],
                 release: Callable[[], None] = lambda: None) -> None:
        """``release()`` puts on ``events`` what the group held back to put on together
        (``WaitingGroup.release_held``): called when a turn brought nothing, and before
        a drain."""
        self._events, self._current, self._release = events, current, release
        self._handlers: dict[type, list[Handler]] = {}
        self._arrivals: list[Callable[[Numbered], None]] = []
        self._next_seq: dict[tuple[int, int, int], int] = {}
        """Per rank, requeue and attempt: the next message number expected."""
        self._ahead: deque[Numbered] = deque()
        """Messages of a newer attempt than the one followed, in the order they came."""
        self._kept: Any = None
        """The message pulled as a wait's gate closed: the next wait dispatches it first."""

    def on(self, kind: type, handler: Handler) -> None:
        """Call ``handler`` with every new message of type ``kind``."""
        self._handlers.setdefault(kind, []).append(handler)

    def on_arrival(self, hook: Callable[[Numbered], None]) -> None:
        """Call ``hook`` with every rank message as it arrives, copies and stale ones too,
        before they are dropped (how a backend notices its ranks' next run)."""
        self._arrivals.append(hook)

    def close(self) -> None:
        """The run is over: drop the handlers and hooks (each refers back to its run's
        supervisor; see ``Supervisor.release``). Nothing is dispatched from now on."""
        self._handlers, self._arrivals, self._kept = {}, [], None
        self._current = _no_attempt

    def _pull(self, timeout: float | None) -> Any:
        """The next event, or None (nothing came, or a copy, a stale message or one held
        for a newer attempt came)."""
        if self._kept is not None:
            event, self._kept = self._kept, None
            return event
        event = self._ahead.popleft() if self._releasable() else self._next(timeout)
        if event is None:
            return None
        if isinstance(event, _NUMBERED):
            sent_by, following = (event.requeue, event.attempt), self._current()
            if sent_by < following:
                return None  # from an attempt that failed or a run SLURM requeued
            if sent_by > following:
                self._ahead.append(event)  # the next attempt's, before it is followed
                return None
        if isinstance(event, Sequenced):
            key = (event.rank, event.requeue, event.attempt)
            if event.seq < self._next_seq.get(key, 0):
                return None  # it came through the rank's other link first
            self._next_seq[key] = event.seq + 1
            return event.message
        return event

    def _next(self, timeout: float | None) -> Any:
        """The next event that came (the backend's hooks see a rank's message first)."""
        try:
            event = self._events.get(timeout=timeout) if timeout else self._events.get_nowait()
        except queue.Empty:
            if timeout:
                self._release()  # (for the next turn)
            return None
        if isinstance(event, _NUMBERED):
            for hook in self._arrivals:
                hook(event)
        return event

    def _releasable(self) -> bool:
        """A held message's attempt is followed now."""
        return bool(self._ahead) and (
            self._ahead[0].requeue, self._ahead[0].attempt) <= self._current()

    def dispatch(self, event: Any) -> None:
        for handler in self._handlers.get(type(event), ()):
            handler(event)

    def run(self, until: Callable[[], bool], seconds: float | None = None, *,
            gate: Callable[[], bool] | None = None, then: Handler | None = None,
            turn: Callable[[], None] | None = None) -> None:
        """Pull and dispatch events until ``until()`` is true or ``seconds`` have passed.

        ``gate()``, if given, is asked between pulling an event and dispatching it: once
        it is false the wait ends, and that event is not dispatched in it (a cancelled
        run takes in nothing more) but kept for the next wait: a session's rank that
        reported just as Ctrl-C was pressed is at rest, and its bring-back must hear it.
        ``then(event)`` follows each dispatched event, ``turn()`` each turn that did not
        end the wait.
        """
        deadline = None if seconds is None else time.monotonic() + seconds
        while not until() and (deadline is None or time.monotonic() < deadline):
            event = self._pull(INTERVAL)
            if gate is not None and not gate():
                self._kept = event
                return
            if event is not None:
                self.dispatch(event)
                if then is not None:
                    then(event)
            if turn is not None and not until():
                turn()

    def drain(self) -> None:
        """Dispatch every event already queued (and held back)."""
        self._release()
        self.run(lambda: self._events.empty() and not self._releasable()
                 and self._kept is None)
