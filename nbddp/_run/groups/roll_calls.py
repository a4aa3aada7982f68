"""The roll calls of a waiting group's ranks: who was asked, and who answered.

Before a waiting group is handed a run, the ranks that wait for their ``Start`` may be
asked to answer (``RollCall``, answered at once from each rank's listening thread, or
for its ranks by a node's relay): a group that lost a process, or whose rank stays
silent for ``ROLL_CALL_WAIT`` seconds, is not handed the run (``RanksGone``). Whether a
group is called at all is the hand-over's choice (``WaitingGroup.hand_over``).

A cluster group whose every rank was heard of in the last ``HEARD_LATELY`` seconds
goes without one (``heard_lately``): it would say no more, and costs a round trip to
every node.

Each call is numbered: an answer to an earlier one counts for nothing. The waiting is
done under the group's lock, which the answers' threads take to say they came.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..._wire.channel import ChannelServer
from ..._wire.messages import Present, RollCall
from ..._wire.relay_messages import RanksPresent
from .group import RanksGone

ROLL_CALL_WAIT = 3.0
"""How long a waiting rank may take to answer its roll call. An idle rank answers within
a millisecond (a few on another node); one that has not answered by then is taken for
stuck, and its group for unfit to run."""
HEARD_LATELY = 1.0
"""Seconds: a cluster group whose every rank's link brought a message this recently is
not called before its next run (cells that follow each other at once go without the
round trip; one typed by hand, seconds later, is called)."""


def heard_lately(server: ChannelServer | None, ranks: list[int]) -> bool:
    """Every one of ``ranks``' links (its own, or its node relay's) brought a message in
    the last ``HEARD_LATELY`` seconds: its process answers, as a roll call would show."""
    return server is not None and not server.quiet(ranks, time.monotonic() - HEARD_LATELY)


class RollCalls:
    """A waiting group's roll calls, numbered; the answers to the latest one."""

    def __init__(self, lock: threading.Lock) -> None:
        """``lock``: the group's, under which every method here is called."""
        self._calls = 0  # roll calls so far: the number of the latest
        self._present: set[int] = set()  # who answered the latest
        self._answered = threading.Condition(lock)

    @staticmethod
    def is_answer(message: Any) -> bool:
        """``message`` answers a roll call (the hand-over's business, not the run's)."""
        return isinstance(message, (Present, RanksPresent))

    def heard(self, answer: Present | RanksPresent) -> None:
        """(Under the lock) ``answer`` came: its ranks are present, if it answers the
        latest call."""
        if answer.call == self._calls:
            self._present.update(answer.ranks if isinstance(answer, RanksPresent)
                                 else (answer.rank,))
            self._answered.notify_all()

    def call(self, server: ChannelServer, ranks: set[int]) -> set[int]:
        """(Under the lock) Ask ``ranks`` to answer a new call; the ranks not reached."""
        self._calls += 1
        self._present = set()
        return server.send_to_each(sorted(ranks), RollCall(self._calls))

    def wake(self) -> None:
        """(Under the lock) The group lost a process: whoever waits for answers stops."""
        self._answered.notify_all()

    def wait(self, called: set[int], gone: Callable[[], str | None],
             check: Callable[[set[int]], None]) -> None:
        """(Under the lock) Wait until every rank ``called`` has answered; RanksGone if
        the group lost a process (``gone()`` says why), or a rank stays silent for
        ``ROLL_CALL_WAIT`` s, or ``check(called)`` (the backend's) finds one stopped since."""
        if not called:
            return
        every = self._answered.wait_for(
            lambda: gone() is not None or called <= self._present, ROLL_CALL_WAIT)
        why = gone()
        if why is not None:
            raise RanksGone(why)
        if not every:
            silent = ", ".join(str(rank) for rank in sorted(called - self._present))
            raise RanksGone(f"rank {silent} did not answer within {ROLL_CALL_WAIT:g} s")
        check(called)
