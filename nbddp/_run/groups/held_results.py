"""A waiting group's Results held back, so that a run's ends wake the kernel once.

While a run's ranks report their ends, a rank's ``Result`` is held back as long as other
ranks have yet to report (a ``Result``, a ``Failure``, a node's ``RanksFinished``, a
requeue, or the rank's link's end): the kernel's thread that follows the run then wakes
once for all of them, not once per rank (each wake-up is a turn of the interpreter lock
between it and the channel's thread, as the next report is read). The last report takes
every held one on with it; so does any other message, a failure at once, or a quiet turn
of the pump (``WaitingGroup.release_held``).

The group's lock guards this: the channel's threads and the kernel's put messages on
the events through it, and no thread's message may go between the held ones and the
message that takes them on.
"""

from __future__ import annotations

import queue
from typing import Any

from ..._wire.messages import Result, run_ended_for


class HeldResults:
    """The Results held back from ``events`` until the run's other ranks report."""

    def __init__(self, events: queue.SimpleQueue[Any]) -> None:
        self._events = events
        self._due: set[int] | None = None  # ranks yet to report on the run
        self._held: list[Any] = []

    def expect(self, nprocs: int) -> None:
        """(Under the group's lock) A run starts: each of its ``nprocs`` ranks is to report."""
        self._due = set(range(nprocs))

    def holds(self, message: Any, inner: Any) -> bool:
        """(Under the group's lock) True if ``message`` (``inner``, unwrapped) is a Result
        held back; it counts towards the run's reports either way."""
        if self._due is None:
            return False
        self._due.difference_update(run_ended_for(message))
        if not self._due:
            self._due = None  # (every rank reported: none is held from now on)
            return False
        if isinstance(inner, Result):
            self._held.append(message)
            return True
        return False

    def put(self, message: Any) -> None:
        """(Under the group's lock) Put the held Results on the events, then ``message``
        (None: nothing more)."""
        held, self._held = self._held, []
        for each in held:
            self._events.put(each)
        if message is not None:
            self._events.put(message)
