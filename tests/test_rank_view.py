"""The per-rank view (``Job.ranks``), stragglers and stall warnings.

Real launches: while a run goes on, every rank's step, speed, memory, pid and host are
there and move; after it they are kept; a rank that trails the others is marked; a run
silent for longer than ``stall_after`` says it looks stalled, once, and moves on.
Through a real kernel: the view during and after a run. Then the pure arithmetic
(speeds, who is behind, the panel's words) on made-up samples.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest

import nbddp
from nbddp._rank import stats as _rank_stats
from nbddp._run.diagnosis.rank_view import RankView
from nbddp._wire.rank_stats import RankStats

from .conftest import wait_until

pytestmark = pytest.mark.waits  # the waiting lane (tests/conftest.py)

# --- functions the ranks run ---------------------------------------------------------


def steps_until(flag: str, fast_rank: int | None = None):
    """Log a step every 0.1 s (``fast_rank``: every 0.02 s, the others every 0.5 s)
    until ``flag`` exists; no collective, so ranks may drift apart."""
    import pathlib
    import time

    import torch.distributed as dist

    pause = 0.1 if fast_rank is None else (0.02 if dist.get_rank() == fast_rank else 0.5)
    step = 0
    while not pathlib.Path(flag).exists():
        nbddp.log(step=step, loss=1.0)
        step += 1
        time.sleep(pause)
    return step


def silent_for(seconds: float):
    import time

    print("starting", flush=True)
    time.sleep(seconds)
    print("moving again", flush=True)
    time.sleep(1.5)
    return "done"


# --- real launches --------------------------------------------------------------------


def test_every_rank_shows_its_step_speed_memory_and_place_while_running_and_after(tmp_path):
    flag = tmp_path / "stop"
    job = nbddp.launch(steps_until, nprocs=2, args=(str(flag),), wait=False, output="none")
    try:
        view = wait_until(lambda: (v := job.ranks) and all(
            (r["step"] or 0) >= 10 and r["steps_per_s"] for r in v.values()) and v,
            timeout=60, interval=0.2)
    finally:
        flag.touch()
    for info in view.values():
        assert info["state"] == "running"
        assert 2 < info["steps_per_s"] < 20  # about 10 a second
        assert info["rss_mb"] > 50  # torch is loaded
        assert info["gpu_mem_mb"] is None  # no CUDA on these ranks
        assert info["host"] == socket.gethostname()
        assert info["pid"] != os.getpid() and info["behind"] is False
    assert view[0]["pid"] != view[1]["pid"]
    last_step = job.result(timeout=60)
    after = job.ranks
    assert {info["state"] for info in after.values()} == {"finished"}
    assert after[0]["step"] >= view[0]["step"] and after[0]["step"] <= last_step


def test_a_sessions_later_cells_show_their_ranks_running(tmp_path):
    """A session's ranks say hello once, as it starts: each cell's ranks run all the same."""
    with nbddp.Session(nprocs=2, output="none") as session:
        for cell in range(2):
            flag = tmp_path / f"stop-{cell}"
            job = session.submit(steps_until, (str(flag),))
            try:
                view = wait_until(lambda: (v := job.ranks) and all(  # noqa: B023
                    (r["step"] or 0) >= 3 for r in v.values()) and v, timeout=60, interval=0.2)
            finally:
                flag.touch()
            assert [info["state"] for info in view.values()] == ["running"] * 2, cell
            job.result(timeout=60)
            assert [info["state"] for info in job.ranks.values()] == ["finished"] * 2
            # (a quiet panel draws no rank: the panel's state says it when asked)
            assert job.state.ranks == ["finished"] * 2, cell
            assert sorted(job.state.rank_notes) == [0, 1] and all(
                note.startswith("step ") for note in job.state.rank_notes.values()), cell


def test_a_rank_that_falls_behind_is_marked(tmp_path):
    flag = tmp_path / "stop"
    job = nbddp.launch(steps_until, nprocs=2, args=(str(flag), 0), wait=False, output="none")
    try:
        view = wait_until(lambda: (v := job.ranks)[1]["behind"] and v, timeout=60, interval=0.2)
    finally:
        flag.touch()
    assert view[0]["behind"] is False and view[0]["step"] > view[1]["step"] + 10
    job.result(timeout=60)


def test_a_silent_run_says_it_looks_stalled_then_moves_on(capfd):
    value = nbddp.launch(silent_for, nprocs=2, args=(4.0,), stall_after=2)
    out = capfd.readouterr().out
    assert value == "done"
    stalled = out.index("nbddp: the run looks stalled: no rank has printed or advanced for 2 s")
    assert out.index("starting") < stalled < out.index("moving again")
    assert "rank 0: in silent_for (test_rank_view.py, line" in out  # where, said at once
    assert "an interrupt stops it and shows each rank's stack" in out


def test_stall_after_must_be_positive_or_none():
    from nbddp._run.config import RunConfig

    with pytest.raises(ValueError, match="stall_after must be a positive number"):
        nbddp.launch(print, stall_after=0)
    assert RunConfig(nprocs=1, stall_after=None).stall_after is None  # never say it


KERNEL_VIEW = """
import pathlib, time
flag = pathlib.Path({flag!r})
{source}
job = nbddp.launch(steps_until, nprocs=2, args=(str(flag),), wait=False)
while (job.ranks[1]["step"] or 0) < 5:
    time.sleep(0.1)
during = job.ranks
flag.touch()
job.result()
after = job.ranks
during[1]["state"], during[1]["step"] >= 5, after[1]["state"], after[1]["pid"] == during[1]["pid"]
"""


def test_the_per_rank_view_in_a_kernel_during_and_after_a_run(kernel, tmp_path):
    import inspect

    source = inspect.getsource(steps_until)
    run = kernel.run(KERNEL_VIEW.format(flag=str(tmp_path / "stop"), source=source))
    run.assert_ok()
    assert run.result() == "('running', True, 'finished', True)"


# --- the arithmetic -------------------------------------------------------------------


def test_a_ranks_stats_read_its_own_gpu_from_the_reporting_thread(monkeypatch):
    """``set_device`` holds for the thread that calls it: the reporting thread's own GPU
    is the first on every rank, so the stats name the rank's GPU (tests/test_gpu.py
    reads real GPU memory this way)."""
    monkeypatch.setattr(_rank_stats, "_device", None)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert _rank_stats.stats_device(4) == 3  # before the rank set its GPU: LOCAL_RANK's
    assert _rank_stats.stats_device(1) == 0  # one GPU of its own (CUDA_VISIBLE_DEVICES)
    _rank_stats.use_device(2)  # the main thread sets the GPU it runs on
    seen: list[int] = []
    reporter = threading.Thread(target=lambda: seen.append(_rank_stats.stats_device(4)))
    reporter.start()
    reporter.join()
    assert seen == [2]



def stats(rank: int, step: int | None, output: int = 0) -> RankStats:
    return RankStats(rank, "node", 100 + rank, step, 1536.0, None, output)


def test_speeds_are_measured_over_the_last_seconds():
    view = RankView(2)
    for second in range(15):
        view.add(stats(0, 2 * second), now=float(second))
        view.add(stats(1, second), now=float(second))
    assert view.steps_per_s(0) == pytest.approx(2.0)
    assert view.steps_per_s(1) == pytest.approx(1.0)
    view.add(stats(1, 14), now=20.0)  # stopped: the window holds samples 10..20
    assert view.steps_per_s(1) == pytest.approx(4 / 10)


def test_behind_means_more_than_two_seconds_of_steps_behind_the_leader():
    view = RankView(3)
    for second in range(5):
        view.add(stats(0, 10 * second), now=float(second))
        view.add(stats(1, 10 * second - 15), now=float(second))  # 1.5 s behind: fine
        view.add(stats(2, 10 * second - 25), now=float(second))  # 2.5 s behind
    assert view.behind() == {2}
    ranks = view.ranks(["running", "running", "running"])
    assert [ranks[r]["behind"] for r in range(3)] == [False, False, True]
    assert view.summary(ranks[2]) == "step 15, 10 steps/s, 1.5 GB, behind"
    assert view.summary(ranks[2], with_host=True) == \
        "on node, step 15, 10 steps/s, 1.5 GB, behind"  # ranks on several nodes


def test_quiet_counts_from_the_last_step_or_output():
    view = RankView(1)
    view.add(stats(0, 1, output=10), now=100.0)
    view.add(stats(0, 1, output=10), now=105.0)  # nothing moved
    assert view.quiet_for(now=110.0) == pytest.approx(10.0)
    view.add(stats(0, 1, output=11), now=111.0)  # a line of output
    assert view.quiet_for(now=112.0) == pytest.approx(1.0)


def test_the_panel_marks_a_rank_behind():
    from nbddp._panel.panel_html import header_html
    from nbddp._panel.state import PanelState
    from nbddp._wire.history import History

    state = PanelState(2, History(2))
    state.ranks = ["running", "running"]
    state.rank_notes, state.behind = {0: "step 40", 1: "step 3, behind"}, {1}
    header = header_html(state)
    assert "1 running (step 3, behind)" in header and "#ff7f0e" in header
    assert "0 running (step 40)" in header


def test_the_panels_header_keeps_the_line_breaks_of_a_longer_message_and_escapes_it():
    """A restart's message may span lines (an exception's text): the header shows them as
    lines, not run together as one paragraph, and shows markup as text."""
    from nbddp._panel.panel_html import header_html
    from nbddp._panel.state import PanelState
    from nbddp._wire.history import History

    state = PanelState(2, History(2))
    state.ranks = ["running", "running"]
    state.status = "running"
    state.message = "attempt 2 of 3: rank 1 raised ValueError:\nshard <17> is empty\ntry again"
    header = header_html(state)
    assert "rank 1 raised ValueError:<br>shard &lt;17&gt; is empty<br>try again" in header
    state.message = "one line"
    assert "<br>" not in header_html(state).split("<br><small>")[0]
