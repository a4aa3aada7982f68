"""The supervisor's pump and an attempt's rank states, as pure logic (no ranks)."""

from __future__ import annotations

import io
import queue
import threading
import time
from concurrent.futures import CancelledError

import pytest

from nbddp._run.attempts import Attempt
from nbddp._run.config import RunConfig
from nbddp._run.groups.group import LauncherExited, RankGroup
from nbddp._run.pump import Pump
from nbddp._run.records import Records
from nbddp._run.supervisor import Supervisor
from nbddp._wire.messages import (
    DebugDone,
    DebugPrompt,
    Disconnected,
    Failure,
    Hello,
    Result,
    Sequenced,
)
from nbddp._wire.rundir import RunDir

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


def pump_over(*events, current=(0, 0)):
    q: queue.SimpleQueue = queue.SimpleQueue()
    for event in events:
        q.put(event)
    return Pump(q, lambda: current), q


def test_a_copy_from_the_other_link_is_dispatched_once():
    pump, _ = pump_over(Sequenced(0, Hello(1, 10)), Sequenced(0, Hello(1, 10)),
                        Sequenced(1, Result(1)))
    seen = []
    pump.on(Hello, seen.append)
    pump.on(Result, seen.append)
    pump.drain()
    assert seen == [Hello(1, 10), Result(1)]


def test_stale_messages_are_dropped_but_arrive_for_the_backend():
    pump, _ = pump_over(Sequenced(0, Hello(0, 1), attempt=0),
                        Disconnected(1, attempt=0), Sequenced(0, Hello(0, 2), attempt=1),
                        current=(0, 1))
    arrived, dispatched = [], []
    pump.on_arrival(arrived.append)
    pump.on(Hello, dispatched.append)
    pump.on(Disconnected, dispatched.append)
    pump.drain()
    assert len(arrived) == 3
    assert dispatched == [Hello(0, 2)]


def test_handlers_run_in_the_order_registered_and_unknown_events_are_ignored():
    pump, _ = pump_over("not a message", Failure(0, "E", "m", "x", "tb"))
    calls = []
    pump.on(Failure, lambda f: calls.append("core"))
    pump.on(Failure, lambda f: calls.append("backend"))
    pump.drain()
    assert calls == ["core", "backend"]


def test_an_event_pulled_after_the_gate_closed_is_not_dispatched():
    pump, q = pump_over(Hello(0, 1), Hello(1, 2))
    seen, gate = [], iter([True, False])
    pump.on(Hello, seen.append)
    pump.run(lambda: False, 5, gate=lambda: next(gate))
    assert seen == [Hello(0, 1)] and q.empty()


def test_a_wait_ends_when_its_condition_holds_then_is_followed_by_each_event():
    pump, q = pump_over(Hello(0, 1), Hello(1, 2), Hello(2, 3))
    seen, then = [], []
    pump.on(Hello, seen.append)
    pump.run(lambda: len(seen) == 2, 5, then=then.append)
    assert seen == then == [Hello(0, 1), Hello(1, 2)] and q.qsize() == 1


def test_a_ranks_state_follows_its_reports():
    attempt = Attempt(4)
    assert attempt.states() == ["starting"] * 4
    assert attempt.states(ended=True) == ["stopped"] * 4  # (stopped before its hello)
    assert attempt.state(0, ended=True) == "stopped"
    attempt.started |= {0, 1, 2}
    attempt.debugging.add(1)
    attempt.results[2] = Result(2)
    failure = Disconnected(3)
    attempt.failures.append(failure)
    assert attempt.states() == ["running", "debugging", "finished", "failed"]
    assert attempt.states(ended=True) == ["stopped", "debugging", "finished", "failed"]
    assert attempt.failed_with(failure) and not attempt.failed_with(Disconnected(3))
    assert attempt.reported == {2} and not attempt.vanished(3) and attempt.vanished(0)


@pytest.fixture
def supervised(tmp_path):
    """A supervisor over a group whose ranks are the test: it puts their messages."""
    made = []

    def make(nprocs=2, **options):
        (tmp_path / "run").mkdir()
        group = RankGroup(nprocs, RunDir(tmp_path / "run"))
        config = RunConfig(nprocs=nprocs, **options)
        sup = Supervisor(group, config, Records(tmp_path), io.StringIO(), group.where)
        made.append(sup)
        return sup, group.events.put

    yield make
    for sup in made:
        sup.close("finished", "")


def said(rank, message, seq, attempt=0):
    return Sequenced(seq, message, attempt=attempt)


def test_the_run_has_returned_once_every_rank_has(supervised):
    sup, put = supervised()
    for rank in (0, 1):
        put(said(rank, Hello(rank, 100 + rank), 0))
    put(said(0, Result(0, b"x"), 1))
    put(said(1, Result(1), 1))
    assert sup.watch(None, lambda: None).kind == "returned"
    assert sup.rank_states() == ["finished", "finished"]


def test_a_failure_with_a_restart_left_follows_the_next_attempt(supervised):
    sup, put = supervised(max_restarts=1)
    put(said(1, Failure(1, "ValueError", "builtins", "boom", "tb"), 0))

    def next_attempt():  # after the failed attempt's last reports were gathered
        put(said(0, Result(0), 0, attempt=0))  # the failed attempt's: stale by now
        put(said(0, Hello(0, 1), 0, attempt=1))
        put(said(1, Failure(1, "ValueError", "builtins", "again", "tb"), 0, attempt=1))

    later = threading.Timer(2.0, next_attempt)
    later.start()
    ending = sup.watch(time.monotonic() + 30, lambda: None)
    later.join()
    assert ending.kind == "failed" and sup.attempt.number == 1
    assert [f.message for f in sup.attempt.failures] == ["again"]
    assert sup.causes[0].message == "boom" and sup.rank_states() == ["running", "failed"]


def test_ranks_that_fail_of_themselves_are_failed_those_that_lose_a_peer_stopped(supervised):
    """After the run's end is decided (rank 1's ValueError), what comes is told apart:
    rank 2's own ValueError (the same bad batch) is a failure, rank 0's broken
    connection and rank 3's death are consequences: stopped."""
    sup, put = supervised(nprocs=4)
    for rank in range(4):
        put(said(rank, Hello(rank, 100 + rank), 0))
    put(said(1, Failure(1, "ValueError", "builtins", "bad batch", "tb"), 1))
    assert sup.watch(time.monotonic() + 30, lambda: None).kind == "failed"
    put(said(2, Failure(2, "ValueError", "builtins", "bad batch", "tb"), 1))
    put(said(0, Failure(0, "RuntimeError", "builtins", "Connection closed by peer", "tb"), 1))
    put(Disconnected(3))
    sup.pump.drain()
    sup.ended = True
    assert sup.rank_states() == ["stopped", "failed", "failed", "stopped"]


def watched_as_torchrun_ends(sup, put, before: list, code: int, after: list):
    """Both ranks say hello and ``before``, then torchrun ends with ``code``, and ``after``
    comes a moment later: how the run ended."""
    for event in [said(0, Hello(0, 100), 0), said(1, Hello(1, 101), 0), *before]:
        put(event)
    put(LauncherExited(code))
    later = threading.Timer(0.3, lambda: [put(event) for event in after])
    later.start()
    ending = sup.watch(time.monotonic() + 30, lambda: None)
    later.join()
    return ending


def test_torchrun_heard_to_end_before_its_ranks_links_the_ranks_are_named_as_they_ended(
        supervised):
    """torchrun is killed mid-run with a node's relay in it: the kernel may hear that it
    ended before the relay's link closes, which says the node's ranks were lost with it.
    The run waits for that (not: "torchrun failed before the ranks ran")."""
    sup, put = supervised()
    ending = watched_as_torchrun_ends(
        sup, put, [], -9, [Disconnected(rank, relay_lost=True) for rank in (0, 1)])
    assert ending.kind == "failed"
    assert [(f.rank, f.relay_lost) for f in sup.attempt.failures] == [(0, True), (1, True)]


def test_torchrun_heard_to_end_before_its_ranks_last_results_the_run_returned(supervised):
    """torchrun ends as its ranks return: their last results, read a moment after its
    end, still make the run's end a return."""
    sup, put = supervised()
    ending = watched_as_torchrun_ends(sup, put, [said(0, Result(0, b"x"), 1)], 0,
                                      [said(1, Result(1), 1)])
    assert ending.kind == "returned"


def test_a_cancelled_run_takes_in_nothing_more(supervised):
    sup, put = supervised()
    put(said(0, Result(0), 0))
    ending = sup.watch(None, lambda: "cancelled")
    assert ending.kind == "stopped" and isinstance(ending.error, CancelledError)
    assert sup.attempt.results == {}


def test_what_came_as_a_run_was_cancelled_is_heard_by_the_next_wait(supervised):
    """A session's rank that reported just as Ctrl-C was pressed is back at rest: the
    bring-back that follows (a next wait on the same pump) must count its report, not
    interrupt it and wait for one that never comes."""
    sup, put = supervised()
    put(said(0, Result(0), 0))
    sup.watch(None, lambda: "interrupted")
    assert sup.attempt.results == {}
    sup.pump.run(lambda: 0 in sup.attempt.reported, 1.0)
    assert set(sup.attempt.results) == {0}


def test_a_rank_back_from_pdb_runs_even_without_a_hello(supervised):
    sup, put = supervised(nprocs=1)  # a session's ranks said hello before its first run
    put(said(0, DebugPrompt(0, "(Pdb) "), 0))
    sup.pump.drain()
    assert sup.rank_states() == ["debugging"]
    put(said(0, DebugDone(0), 1))
    sup.pump.drain()
    assert sup.rank_states() == ["running"]
    sup.ended = True
    assert sup.rank_states() == ["stopped"]


def test_the_next_attempts_messages_wait_until_it_is_followed():
    """torchrun's next attempt can report before the failed one's last reports are
    gathered: its result must count for it, not vanish with the attempt before."""
    current = [(0, 0)]
    q: queue.SimpleQueue = queue.SimpleQueue()
    pump = Pump(q, lambda: current[0])
    for event in (Sequenced(0, Failure(0, "RuntimeError", "builtins", "first attempt", ""),
                            attempt=0),
                  Sequenced(0, Result(1), attempt=1), Disconnected(1, attempt=1)):
        q.put(event)
    dispatched = []
    for kind in (Failure, Result, Disconnected):
        pump.on(kind, dispatched.append)
    pump.drain()
    assert [type(event) for event in dispatched] == [Failure]
    current[0] = (0, 1)  # the supervisor follows the next attempt
    pump.drain()
    assert dispatched[1:] == [Result(1), Disconnected(1, attempt=1)]
