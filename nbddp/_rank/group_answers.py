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
from collections.abc import Iterable
from typing import Any

from .._wire.messages import (
    HEADER_SIZE,
    Disconnected,
    Present,
    RanksPresent,
    RollCall,
    Sequenced,
    Start,
    decode,
    run_ended_for,
)

WHOLE_WAIT = 0.25
"""Seconds a head holds its group's ends while some of the group have not said theirs:
the panel shows a rank finished at most this late (only in a tree: 64 nodes or more)."""

class GroupAnswers:
    """Of the ranks the head handed the last Start (or roll call) to, those that have not
    said their end (their answer) yet. ``expect`` and ``unreached`` are called as the
    head hands messages down (``relay.HeadDown``), ``heard`` as its group's messages
    come up: two threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kind: type | None = None  # Start or RollCall: what is awaited
        self._handed: set[int] = set()  # the ranks it went to
        self._waiting: set[int] = set()  # ... that have not answered yet

    def expect(self, ranks: tuple[int, ...], frame: bytes) -> None:
        """The head hands ``frame`` down to ``ranks`` of its group: if it is a Start or a
        roll call, wait for those ranks' ends or answers. A cell's Start may come in
        parts (a node's when its copy of the payload is kept, a rank's when it says
        hello): ranks it did not go to yet are awaited along with the others; one it
        went to already means the next cell's."""
        try:
            kind = type(decode(memoryview(frame)[HEADER_SIZE:]))
        except Exception:  # noqa: BLE001 - the ranks are told it all the same; unawaited
            return
        if kind not in (Start, RollCall):
            return
        with self._lock:
            if kind is not self._kind or not self._handed.isdisjoint(ranks):
                self._kind, self._handed, self._waiting = kind, set(), set()
            self._handed.update(ranks)
            self._waiting.update(ranks)

    def unreached(self, ranks: Iterable[int]) -> None:
        """The head could not hand the message on to ``ranks`` (gone): none will answer."""
        with self._lock:
            self._waiting.difference_update(ranks)

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
        return run_ended_for(message)
    if kind is RollCall:
        if isinstance(message, RanksPresent):
            return message.ranks
        if isinstance(message, Sequenced) and isinstance(message.message, Present):
            return (message.message.rank,)
    return ()
