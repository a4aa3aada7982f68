"""The panel with many ranks (``_panel.many_ranks``): counts per state and the few ranks
worth naming, every rank on demand; and the rank states it reads, worked out for
thousands of ranks at once (pure logic: no ranks started)."""

from __future__ import annotations

import random

import pytest

from nbddp._panel.many_ranks import MANY_RANKS, counts, notable
from nbddp._panel.panel_html import header_html
from nbddp._panel.state import PanelState
from nbddp._panel.text_panel import text_view
from nbddp._run.attempts import Attempt
from nbddp._wire.history import History
from nbddp._wire.messages import Disconnected, Failure, Result

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


def failure(rank: int, message: str = "boom", type_name: str = "ValueError") -> Failure:
    return Failure(rank, type_name, "builtins", message, "Traceback ...")


def test_counts_say_how_many_ranks_are_in_each_state_the_troubling_first():
    assert counts(["running"] * 60 + ["failed"] + ["finished"] * 3) == \
        "1 failed, 60 running, 3 finished"


def test_the_ranks_named_are_the_failed_the_behind_the_slowest_and_the_fastest():
    states = ["running"] * 40
    states[7] = states[9] = states[11] = states[13] = "failed"
    rates = {rank: 10.0 for rank in range(40)} | {20: 2.0, 30: 15.0, 7: None}
    named = notable(states, reported=[13, 9, 11, 7, 9], behind={20, 21, 22, 23}, rates=rates)
    assert named == [("failed", 7), ("failed", 9), ("failed", 11),  # three, the rest counted
                     ("behind", 20), ("behind", 21), ("behind", 22),
                     ("fastest", 30)]  # (the slowest, 20, is named already: behind)


def many(nprocs: int = 40) -> PanelState:
    state = PanelState(nprocs, History(nprocs))
    state.ranks = ["running"] * nprocs
    state.ranks[5] = "failed"
    state.notable = [("failed", 5), ("slowest", 12)]
    state.rank_notes = {5: "step 3", 12: "step 9, 1.2 steps/s"}
    return state


def test_the_header_of_many_ranks_counts_them_and_names_a_few():
    header = header_html(many())
    assert "40: 1 failed, 39 running" in header
    assert "failed <span" in header and "5 failed (step 3)" in header
    assert "slowest <span" in header and "12 running (step 9, 1.2 steps/s)" in header
    assert "&#9679;" in header and header.count("&#9679;") == 2  # two chips, not forty


def test_the_text_panel_of_many_ranks_says_counts_and_the_named_ranks():
    line = text_view(many()).splitlines()[0]
    assert line == ("nbddp: running (ranks: 40: 1 failed, 39 running; failed 5 (step 3); "
                    "slowest 12 (step 9, 1.2 steps/s))")


def test_a_few_ranks_still_get_a_chip_each():
    state = PanelState(MANY_RANKS, History(MANY_RANKS))
    state.ranks = ["running"] * MANY_RANKS
    assert header_html(state).count("&#9679;") == MANY_RANKS


def test_every_rank_s_state_at_once_is_each_rank_s_state():
    rng = random.Random(3)
    for _ in range(200):
        nprocs = rng.randint(1, 40)
        attempt = Attempt(nprocs)
        for rank in range(nprocs):
            roll = rng.random()
            if roll < 0.8:
                attempt.started.add(rank)
            if roll < 0.1:
                attempt.debugging.add(rank)
            if 0.1 <= roll < 0.2:
                attempt.requeueing.add(rank)
            if 0.2 <= roll < 0.5:
                attempt.results[rank] = Result(rank)
            elif 0.5 <= roll < 0.6:
                attempt.failures.append(failure(rank))
            elif 0.6 <= roll < 0.65:
                attempt.failures.append(failure(rank, "Connection reset by peer",
                                                "DistNetworkError"))
            elif 0.65 <= roll < 0.7:
                attempt.failures.append(Disconnected(rank))
            if rng.random() < 0.1:
                attempt.stopped.add(rank)
        for ended in (False, True):
            assert attempt.states(ended) == [attempt.state(r, ended) for r in range(nprocs)]


def test_every_rank_s_state_asked_again_and_again_as_reports_come_is_each_rank_s_state():
    """The panel asks ten times a second while reports come (every rank started, or not
    yet): each answer is what each rank's own state says."""
    rng = random.Random(5)
    for _ in range(100):
        nprocs = rng.randint(1, 24)
        attempt = Attempt(nprocs)
        for _ in range(rng.randint(1, 60)):
            rank, roll = rng.randrange(nprocs), rng.random()
            if roll < 0.3:
                attempt.started.add(rank)
            elif roll < 0.6:
                attempt.finished_quietly((rank, rng.randrange(nprocs)))
            elif roll < 0.7:
                attempt.results[rank] = Result(rank)
            elif roll < 0.8:
                attempt.debugging.symmetric_difference_update({rank})
            elif roll < 0.85:
                attempt.requeueing.add(rank)
            elif roll < 0.9:
                attempt.failures.append(failure(rank))
            elif roll < 0.95:
                attempt.stopped.add(rank)
            ended = rng.random() < 0.2
            assert attempt.states(ended) == [attempt.state(r, ended) for r in range(nprocs)]
