"""Which of the ranks a relay speaks for it still waits to hear from: a node's relay, its
node's ranks; a group's head (``_wire.relay_tree``), its node's and its group's.

A relay merges its ranks' ends of a run (and answers to a roll call) into one message
for the kernel. Sent as they came, ranks that end apart (ranks that share cores, a
straggler) sent a part each: four or five frames per node per cell at eight ranks a
node, and five or six per group at a head, each read, checked and decoded by the
kernel. The relay knows whom it handed the run's Start (or the roll call) to: until
every one of them has said its end, it holds what came, up to ``WHOLE_WAIT``, and sends
the end as one message once the last one has spoken. The run's end waits for its last
rank anyway. Holding is only ever a matter of when: a message that is not merged (a
failure, a prompt, a value) goes on at once with what was held.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from .._wire.frames import HEADER_SIZE, decode
from .._wire.messages import Disconnected, Present, RollCall, Sequenced, Start, run_ended_for
from .._wire.relay_messages import RanksPresent

WHOLE_WAIT = 0.25
"""Seconds a relay holds its ranks' ends while some of them have not said theirs: the
panel shows a rank finished at most this late."""

class GroupAnswers:
    """Of the ranks the relay handed the last Start (or roll call) to, those that have not
    said their end (their answer) yet. ``expect`` and ``unreached`` are called as the
    relay hands messages down, ``heard`` as its ranks' messages come up: two threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kind: type | None = None  # Start or RollCall: what is awaited
        self._handed: set[int] = set()  # the ranks it went to
        self._waiting: set[int] = set()  # ... that have not answered yet

    def expect(self, ranks: tuple[int, ...], frame: bytes) -> None:
        """The relay hands ``frame`` down to ``ranks``: if it is a Start or a roll call,
        wait for those ranks' ends or answers. A cell's Start may come in
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
        """The relay could not hand the message on to ``ranks`` (gone): none will answer."""
        with self._lock:
            self._waiting.difference_update(ranks)

    def heard(self, message: Any) -> None:
        """``message`` came up from the ranks: those it ends for are no longer awaited."""
        with self._lock:
            if self._waiting:
                self._waiting.difference_update(_answering(message, self._kind))

    def awaited(self) -> bool:
        """Some ranks handed the last Start or roll call have not answered yet."""
        return bool(self._waiting)

    def answered(self) -> bool:
        """A Start or roll call was handed down, and every rank it went to has answered."""
        return self._kind is not None and not self._waiting


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
