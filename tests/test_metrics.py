"""nbddp.log / nbddp.progress: averaged over ranks in the kernel, shown live, kept."""

from __future__ import annotations

import json
import time

import pytest

import nbddp
from nbddp._rank.reporter import until_next_beat
from nbddp._wire.history import History, read_history

pytestmark = pytest.mark.waits  # the waiting lane (tests/conftest.py)


def train_and_log(steps):
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    for step in nbddp.progress(range(steps), desc="epoch"):
        nbddp.log(step=step, loss=torch.tensor(float(step * 10 + rank)), lr=0.1)
    return "trained"


@pytest.mark.fast
def test_every_rank_sends_on_the_same_beat_of_the_clock():
    """Ranks that started at different moments send together: the kernel wakes for
    their reports once per beat, not once per rank."""
    for now in (1000.0, 1000.03, 1000.0999, 1000.05, 1234.5678):
        wait = until_next_beat(now)
        beat = round((now + wait) * 10)
        assert now + wait == pytest.approx(beat / 10, abs=1e-6)  # (on a tenth of a second)
        assert 0.01 < wait <= 0.11  # (never twice at once, never a beat skipped for long)
    assert until_next_beat(1000.0999) == pytest.approx(0.1001)  # (too close: the next one)


@pytest.mark.fast
def test_metrics_are_averaged_over_ranks_per_step():
    job = nbddp.launch(train_and_log, 3, args=(50,), wait=False)
    assert job.result(timeout=120) == "trained"
    history = job.history
    assert [row["step"] for row in history] == list(range(50))
    for row in history:  # mean over ranks 0, 1, 2 of step*10 + rank
        assert row["loss"] == pytest.approx(row["step"] * 10 + 1)
        assert row["lr"] == pytest.approx(0.1)
        assert row["ranks"] == 3
    assert nbddp.last_job() is job
    kept = [json.loads(line) for line in (job.records / "metrics.jsonl").read_text().splitlines()]
    assert kept == history  # the full history is on disk too


def test_text_panel_shows_progress_and_averaged_metrics(capfd):
    nbddp.launch(train_and_log, 2, args=(30,))
    out = capfd.readouterr()
    text = out.out + out.err
    assert "30/30" in text  # rank 0's progress reached the end
    assert "loss=290.5" in text  # the last step's mean: (290 + 291) / 2
    assert "nbddp: finished on 2 ranks" in text


def test_step_none_counts_each_ranks_calls_and_bad_values_are_left_out(capfd):
    def fn():
        for i in range(5):
            nbddp.log(value=i, label="not a number")
        return True

    job = nbddp.launch(fn, 2, wait=False)
    assert job.result(timeout=60)
    assert [(row["step"], row["value"]) for row in job.history] == [(i, i) for i in range(5)]
    assert all("label" not in row for row in job.history)
    assert "is not a number or a 0-d tensor" in job.logs[0]


def test_a_rank_that_never_logs_does_not_hold_the_average_back():
    def fn():
        import torch.distributed as dist

        if dist.get_rank() == 0:
            for step in range(3):
                nbddp.log(step=step, loss=float(step))
                time.sleep(1.5)
        return True

    job = nbddp.launch(fn, 2, wait=False)
    job.result(timeout=60)
    assert [(r["step"], r["loss"], r["ranks"]) for r in job.history] == [
        (0, 0.0, 1), (1, 1.0, 1), (2, 2.0, 1)]


def test_outside_a_run_log_does_nothing_and_progress_is_tqdm(capsys):
    from tqdm.auto import tqdm

    nbddp.log(loss=1.0)  # never raises
    nbddp.log(step=3, loss="anything")
    bar = nbddp.progress(range(3), desc="plain")
    assert isinstance(bar, tqdm)
    assert list(bar) == [0, 1, 2]


def test_a_flood_of_output_is_bounded_and_the_full_log_kept(capfd):
    def flood():
        for i in range(100_000):
            print(f"line {i}")
        return "flooded"

    job = nbddp.launch(flood, 2, wait=False)
    assert job.result(timeout=120) == "flooded"
    out = capfd.readouterr().out
    assert out.count("\nline ") < 1100  # at most about 1000 lines shown
    assert f"the full log is {job.records}" in out
    assert "line 99999" in out  # the last lines are shown at the end
    assert "line 50000" not in out
    full = (job.records / "rank-0.log").read_text().splitlines()
    # Every line the rank printed is kept, whole and in order. The log also keeps what
    # the process wrote itself (a warning of torch's on stderr): shown if there is any.
    ours = [line for line in full if line.startswith("line ")]
    others = [line for line in full if not line.startswith("line ")]
    assert ours == [f"line {i}" for i in range(100_000)], f"besides the lines: {others[:5]}"
    assert not any("line" in line for line in others), f"a line was split: {others[:5]}"


def test_history_keeps_memory_bounded_and_disk_complete(tmp_path):
    history = History(nprocs=2, path=tmp_path / "m.jsonl")
    for step in range(10_000):
        history.add(0, [(step, {"loss": float(step)})])
        history.add(1, [(step, {"loss": float(step) + 2})])
    history.close()
    points = history.series["loss"]
    assert len(points) <= 1000
    assert points[-1] == (9999, 10000.0)  # the newest point is always kept
    rows = (tmp_path / "m.jsonl").read_text().splitlines()
    assert len(rows) == 10_000
    assert json.loads(rows[1234]) == {"step": 1234, "ranks": 2, "loss": 1235.0}


def test_logging_100k_times_a_second_is_coalesced(capfd):
    def hammer(n):
        for i in range(n):
            nbddp.log(step=i, loss=float(i))
        return n

    start = time.monotonic()
    job = nbddp.launch(hammer, 2, args=(100_000,), wait=False)
    assert job.result(timeout=300) == 100_000
    seconds = time.monotonic() - start
    history = job.history
    assert len(history) == 100_000 and history[-1] == {"step": 99_999, "ranks": 2, "loss": 99_999}
    redraws = capfd.readouterr().out.count("\r")  # tqdm redraws its line with a carriage return
    assert redraws > 0
    assert redraws <= 10 * seconds + 10  # at most about ten redraws a second


def test_a_late_rank_is_left_out_once_and_a_restarted_step_counter_makes_new_rows(tmp_path):
    history = History(nprocs=2, path=tmp_path / "m.jsonl")
    history.add(0, [(0, {"loss": 1.0}), (1, {"loss": 1.0})])
    history._first_seen = {step: 0.0 for step in history._first_seen}  # waited long enough
    history.tick()
    assert [(r["step"], r["ranks"]) for r in _rows(history)] == [(0, 1)]  # step 1 is newest
    history.add(1, [(0, {"loss": 3.0}), (1, {"loss": 3.0})])  # rank 1, late for step 0
    assert history.late_records == 1
    history.add(0, [(0, {"loss": 5.0})])  # rank 0 counts from 0 again: a new row
    history.add(1, [(0, {"loss": 7.0})])
    history.close()
    assert [(r["step"], r["ranks"], r["loss"]) for r in _rows(history)] == [
        (0, 1, 1.0), (1, 2, 2.0), (0, 2, 6.0)]


def test_late_records_are_recognised_after_the_step_is_forgotten(tmp_path, monkeypatch):
    from nbddp._wire import history as _history

    monkeypatch.setattr(_history, "_RECENT", 10)  # remember only the last 10 averaged steps
    history = History(nprocs=2, path=tmp_path / "m.jsonl")
    history.add(0, [(step, {"loss": 1.0}) for step in range(100)])
    history._first_seen = {step: 0.0 for step in history._first_seen}
    history.tick()  # steps 0..98 averaged over rank 0 alone; 99 is rank 0's newest
    history.add(1, [(step, {"loss": 3.0}) for step in range(100)])  # rank 1, far behind
    history.close()
    rows = _rows(history)
    assert [r["step"] for r in rows] == list(range(100))  # one row a step, in order
    assert history.late_records == 99 and rows[-1] == {"step": 99, "ranks": 2, "loss": 2.0}


def _rows(history):
    return read_history(history.path)


def test_a_record_for_all_ranks_is_shown_at_once_not_waited_for(tmp_path):
    history = History(nprocs=2, path=tmp_path / "m.jsonl")
    history.add(0, [(0, {"loss": 4.0})], for_all=True)  # e.g. Accelerate's main process
    assert history.latest == {"step": 0, "ranks": 1, "loss": 4.0}  # no tick, no waiting
    history.add(0, [(1, {"acc": 1.0})])  # an ordinary record still waits for rank 1
    assert history.latest["step"] == 0
    history.add(1, [(1, {"acc": 0.0})])
    history.close()
    assert [(r["step"], r["ranks"]) for r in _rows(history)] == [(0, 1), (1, 2)]


def test_a_script_run_keeps_the_for_all_mark_through_its_files(tmp_path):
    from nbddp._rank.script_metrics import ScriptReporter
    from nbddp._wire.messages import Metrics

    reporter = ScriptReporter(0, 2, tmp_path)
    reporter._write(Metrics(0, [(0, {"a": 1.0})], None, [(0, {"loss": 2.0})]))
    records, for_all, finished = reporter._read(0)
    assert (records, for_all, finished) == ([(0, {"a": 1.0})], [(0, {"loss": 2.0})], False)
    reporter._stop.set()
    reporter._thread.join()
    reporter._file.close()


def test_nodes_sums_and_ranks_own_records_average_to_the_mean_over_every_rank(tmp_path):
    """A node's relay sends its ranks' sum and count per step and metric; the mean over
    every rank's value stays exact, whichever way each rank's records came."""
    history = History(nprocs=5, path=tmp_path / "m.jsonl")
    values = {rank: 10.0 * rank + 1 for rank in range(5)}
    history.add_reduced([(0, (0, 1), {"loss": (values[0] + values[1], 2)})])
    history.add(4, [(0, {"loss": values[4]})])
    assert history.latest == {}  # ranks 2 and 3 not heard yet
    history.add_reduced([(0, (2, 3), {"loss": (values[2] + values[3], 2)})])
    assert history.latest == {"step": 0, "ranks": 5,
                              "loss": pytest.approx(sum(values.values()) / 5)}
    history.add_reduced([(0, (0, 1), {"loss": (2.0, 2)})])  # counter started over: a new row
    history.add_reduced([(1, (0, 1, 2, 3), {"loss": (8.0, 4)}), (1, (4,), {"acc": (1.0, 1)})])
    history.close()
    assert [(r["step"], r["ranks"]) for r in _rows(history)] == [(0, 5), (0, 2), (1, 5)]
    assert _rows(history)[2] == {"step": 1, "ranks": 5, "loss": 2.0, "acc": 1.0}


def test_a_node_s_sum_late_for_its_step_is_dropped_and_counted(tmp_path):
    history = History(nprocs=4, path=tmp_path / "m.jsonl")
    history.add_reduced([(0, (0, 1), {"loss": (2.0, 2)}), (1, (0, 1), {"loss": (2.0, 2)})])
    history._first_seen = {step: 0.0 for step in history._first_seen}  # waited long enough
    history.tick()  # step 0 averaged over ranks 0 and 1 (step 1 is newest)
    history.add_reduced([(0, (2, 3), {"loss": (6.0, 2)})])  # the other node, late
    assert history.late_records == 2
    history.close()
    assert [(r["step"], r["ranks"], r["loss"]) for r in _rows(history)] == [
        (0, 2, 1.0), (1, 2, 1.0)]
