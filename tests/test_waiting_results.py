"""A waiting group's Results reach the run together: the thread that follows the run
wakes once for a cell's ranks, not once per rank (pure logic: no ranks, no channel)."""

from __future__ import annotations

import sys

import pytest

from nbddp._run.groups.shape import GroupShape, Handover
from nbddp._run.groups.waiting import WaitingGroup
from nbddp._run.pump import Pump
from nbddp._run.records import Records
from nbddp._wire.dataplane import Packed
from nbddp._wire.messages import Disconnected, Failure, RankOptions, Result, Sequenced
from nbddp._wire.rank_stats import StatsColumns
from nbddp._wire.relay_messages import RanksFinished
from nbddp._wire.rundir import RunDir

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


class _Channel:
    """Where the group sends its Starts (here, to no rank: none has said hello)."""

    def send_to_each(self, ranks, message):
        return set()


def handed_a_run(tmp_path, nprocs: int = 3) -> WaitingGroup:
    (tmp_path / "run").mkdir()
    shape = GroupShape(sys.executable, nprocs, None, 0, "gloo", True, {}, str(tmp_path))
    group = WaitingGroup(shape, RunDir(tmp_path / "run"))
    group._server = _Channel()
    group.hand_over(Packed(b"payload", []), Records(tmp_path), RankOptions(), Handover())
    return group


def queued(group: WaitingGroup) -> list:
    taken = []
    while not group.events.empty():
        event = group.events.get_nowait()
        taken.append(event.message if isinstance(event, Sequenced) else event)
    return taken


def test_results_are_held_until_the_last_rank_s_then_go_in_the_order_they_came(tmp_path):
    group = handed_a_run(tmp_path)
    group._deliver(Sequenced(0, Result(2)))
    group._deliver(Sequenced(0, Result(0)))
    assert group.events.empty()
    group._deliver(Sequenced(0, Result(1)))
    assert queued(group) == [Result(2), Result(0), Result(1)]


def test_a_failure_goes_at_once_with_the_results_held_before_it(tmp_path):
    group = handed_a_run(tmp_path, nprocs=4)
    group._deliver(Sequenced(0, Result(1)))
    failure = Failure(0, "ValueError", "bad batch", "Traceback...", "")
    group._deliver(Sequenced(0, failure))
    assert queued(group) == [Result(1), failure]
    group._deliver(Sequenced(0, Result(2)))  # (the failed rank's report counts: one
    assert group.events.empty()  # more is due, rank 3's)
    group._deliver(Sequenced(0, Result(3)))
    assert queued(group) == [Result(2), Result(3)]


def test_a_node_relay_s_batch_counts_for_each_of_its_ranks(tmp_path):
    group = handed_a_run(tmp_path, nprocs=4)
    batch = RanksFinished((1, 2, 3), StatsColumns.of([]))  # (what a relay says for them)
    group._deliver(Sequenced(0, Result(0)))  # rank 0's (it carries the cell's value)
    group._deliver(batch)
    assert queued(group) == [Result(0), batch]
    group.hand_over(Packed(b"payload", []), Records(tmp_path), RankOptions(), Handover())
    group._deliver(batch)
    group._deliver(Sequenced(1, Result(0)))  # the last: not held, nothing to wait for
    assert queued(group) == [batch, Result(0)]


def test_any_other_message_takes_the_held_results_on_before_it(tmp_path):
    group = handed_a_run(tmp_path)
    group._deliver(Sequenced(0, Result(1)))
    gone = Disconnected(2)  # (rank 2's process died)
    group._deliver(gone)
    assert queued(group) == [Result(1), gone]


def test_a_run_after_one_whose_reports_did_not_all_come_counts_afresh(tmp_path):
    group = handed_a_run(tmp_path)
    group._deliver(Sequenced(0, Result(0)))
    group.release_held()  # (the run ended without the others: stopped, say)
    assert queued(group) == [Result(0)]
    group.hand_over(Packed(b"payload", []), Records(tmp_path), RankOptions(), Handover())
    for rank in range(2):
        group._deliver(Sequenced(1, Result(rank)))
    assert group.events.empty()
    group._deliver(Sequenced(1, Result(2)))
    assert queued(group) == [Result(0), Result(1), Result(2)]


def test_a_quiet_turn_of_the_pump_releases_what_is_held(tmp_path):
    group = handed_a_run(tmp_path)
    pump = Pump(group.events, lambda: (0, 0), group.release_held)
    seen: list = []
    pump.on(Result, seen.append)
    group._deliver(Sequenced(0, Result(1)))  # rank 1 is done; 0 and 2 are still running
    assert group.events.empty()
    pump.run(lambda: bool(seen), seconds=5.0)
    assert seen == [Result(1)]


def test_a_drain_takes_in_what_is_held(tmp_path):
    group = handed_a_run(tmp_path)
    pump = Pump(group.events, lambda: (0, 0), group.release_held)
    seen: list = []
    pump.on(Result, seen.append)
    pump.on(Disconnected, seen.append)
    group._deliver(Sequenced(0, Result(0)))
    pump.drain()
    assert seen == [Result(0)]
