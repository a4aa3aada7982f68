"""Which of its group's ranks a group's head still waits to hear from (``_wire.relay_tree``).

A head merges its group's ends of a run (and answers to a roll call) into one message
for the kernel. It waits a moment after each report for the next (``relay._GROUP_GAP``),
which merges a group whose nodes end together. Where they end spread out (nodes that
share cores, a straggler), each gap sent a part: five or six frames per group per cell,
each read, checked and decoded by the kernel. The head knows whom it handed the run's
Start (or the roll call) to: until every one of them has said its end, it holds what
came, up to ``WHOLE_WAIT``, and sends the group's end as one message once the last one
has spoken. Holding is only ever a matter of when: a message that is not merged (a
failure, a prompt) goes on at once with what was held.
"""

from __future__ import annotations

import threading
from typing import Any

from .._wire.messages import (
    HEADER_SIZE,
    Disconnected,
    Failure,
    Present,
    RanksFinished,
    RanksPresent,
    Requeueing,
    Result,
    RollCall,
    Sequenced,
    Start,
    ToRanks,
    decode,
)

WHOLE_WAIT = 0.25
"""Seconds a head holds its group's ends while some of the group have not said theirs:
the panel shows a rank finished at most this late (only in a tree: 64 nodes or more)."""

_ENDS = (Result, Failure, Requeueing)


class GroupAnswers:
    """The ranks whose end of the run (or answer to the roll call) the head handed on last
    has not come yet. ``expect`` is called as the head hands a message down, ``heard``
    as its group's messages come up: two threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kind: type | None = None  # Start or RollCall: what is awaited
        self._waiting: set[int] = set()

    def expect(self, message: ToRanks) -> None:
        """The head hands ``message`` down to its group's ranks: if it is a Start or a
        roll call, wait for those ranks' ends or answers (instead of the last one's)."""
        try:
            kind = type(decode(memoryview(message.frame)[HEADER_SIZE:]))
        except Exception:  # noqa: BLE001 - the ranks are told it all the same; unawaited
            return
        if kind in (Start, RollCall):
            with self._lock:
                self._kind, self._waiting = kind, set(message.ranks)

    def heard(self, message: Any) -> None:
        """``message`` came up from the group: the ranks it ends for are no longer awaited."""
        with self._lock:
            if self._waiting:
                self._waiting.difference_update(_answering(message, self._kind))

    def awaited(self) -> bool:
        """Some ranks handed the last Start or roll call have not answered yet."""
        return bool(self._waiting)


def _answering(message: Any, kind: type | None) -> tuple[int, ...]:
    """The ranks ``message`` says the awaited answer for (a rank whose link closed will
    say nothing more: it counts as heard)."""
    if isinstance(message, Disconnected):
        return (message.rank,)
    if kind is Start:
        if isinstance(message, RanksFinished):
            return message.ranks
        if isinstance(message, Sequenced) and isinstance(message.message, _ENDS):
            return (message.message.rank,)
    elif kind is RollCall:
        if isinstance(message, RanksPresent):
            return message.ranks
        if isinstance(message, Sequenced) and isinstance(message.message, Present):
            return (message.message.rank,)
    return ()
