"""Where a step's time goes: the rank's clock (with a real DDP model in a one-rank gloo
group) and the kernel's split of it. The run through a kernel is in test_panel."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from nbddp._rank.reporter import Reporter
from nbddp._rank.step_clock import SAMPLE_EVERY, StepClock
from nbddp._run.diagnosis.time_split import WINDOW, TimeSplit, holder, split_lines
from nbddp._wire.rank_stats import StepTimes

pytestmark = pytest.mark.fast


def times(rank, steps, data, step, comm=0.0, samples=0):
    return StepTimes(rank, steps, data, step, comm, samples)


def test_shares_add_up_and_the_rank_that_waits_least_in_collectives_holds_the_others_back():
    split = TimeSplit()
    split.add(times(0, 10, 0.0, 1.0, comm=0.07, samples=1), now=0.0)  # 0.1 s/step
    split.add(times(1, 10, 0.6, 0.4, comm=0.0, samples=1), now=0.0)
    splits = split.splits()
    assert splits[0].collectives == pytest.approx(0.7)
    assert splits[1].data == pytest.approx(0.6)
    for s in splits.values():
        assert s.data + s.compute + s.collectives == pytest.approx(1.0)
    assert holder(splits) == "rank 1: 60% of its step waiting for data"
    assert split_lines(splits)[0] == "rank 0: data 0% compute 30% collectives 70% (100 ms/step)"


def test_without_a_ddp_model_the_rank_that_waits_most_for_data_is_named():
    split = TimeSplit()
    split.add(times(0, 10, 0.1, 0.9), now=0.0)
    split.add(times(1, 10, 0.5, 0.5), now=0.0)
    splits = split.splits()
    assert not splits[0].collectives_measured
    assert holder(splits) == "rank 1: 50% of its step waiting for data"
    assert split_lines(splits)[0] == "rank 0: data 10% compute 90% (100 ms/step)"


def test_the_split_follows_the_last_seconds_not_the_whole_run():
    split = TimeSplit()
    split.add(times(0, 100, 0.0, 10.0), now=0.0)  # computing at first
    split.add(times(0, 110, 9.0, 11.0), now=WINDOW)  # then waiting for data: 0.9 s a step
    split.add(times(0, 111, 9.9, 11.1), now=WINDOW + 1)
    (only,) = split.splits().values()
    assert only.data == pytest.approx(9.9 / 11.0)
    assert holder(split.splits()) == ""  # one rank holds nobody back


def test_a_restart_forgets_the_last_attempts_steps():
    split = TimeSplit()
    split.add(times(0, 10, 1.0, 1.0), now=0.0)
    split.restart()
    assert split.splits() == {}


CLOCK_IN_A_DDP_LOOP = """
import json, sys, tempfile, time
import torch
import torch.distributed as dist
from nbddp._rank.reporter import Reporter
from nbddp._rank.step_clock import SAMPLE_EVERY
from nbddp._wire.rank_stats import StepTimes

dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0,
                        world_size=1)
hooks = torch.nn.modules.module._global_forward_pre_hooks
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
sent = []
reporter = Reporter(0, sent.append, stats=True)

def batches():
    for _ in range(2 * SAMPLE_EVERY):
        time.sleep(0.01)
        yield torch.randn(4, 8)

hooks_while_looking = None
for step, x in enumerate(reporter.track(batches(), None, None)):
    model(x).sum().backward()
    if step == 0:
        hooks_while_looking = len(hooks)
reporter.close()
print(json.dumps({"totals": reporter.clock.totals._asdict(), "hooks": len(hooks),
                  "hooks_while_looking": hooks_while_looking,
                  "sent": [m.steps for m in sent if isinstance(m, StepTimes)]}))
dist.destroy_process_group()
"""


def test_the_clock_times_the_wait_for_data_and_reads_ddps_all_reduce():
    pytest.importorskip("torch")  # (its own process: gloo keeps a socket until exit)
    done = subprocess.run([sys.executable, "-c", CLOCK_IN_A_DDP_LOOP], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    totals = seen["totals"]
    assert totals["steps"] == 2 * SAMPLE_EVERY
    assert totals["data_s"] >= 2 * SAMPLE_EVERY * 0.01
    assert totals["comm_samples"] >= 2  # DDP's timer samples, read every tenth step
    assert seen["hooks_while_looking"] == 1  # DDP models looked for as the loop begins
    assert seen["hooks"] == 0  # and no hook left on every module's forward
    assert seen["sent"][-1] == 2 * SAMPLE_EVERY


def test_a_framework_marks_its_own_steps_and_a_pause_is_no_wait_for_data():
    clock = StepClock()
    clock.batch_ready()  # Lightning's first on_train_batch_start
    clock.batch_asked()  # its on_train_batch_end
    clock.loop_ended()  # validation begins
    time.sleep(0.05)
    clock.batch_ready()
    clock.batch_asked()
    assert clock.totals.steps == 2
    assert clock.totals.data_s < 0.05


def test_a_resumed_reporter_keeps_an_unmarked_clock_and_starts_a_marked_one_afresh():
    """A session's rank takes its reporter up again for each run: quick cells mark no
    step and share one clock; a run whose loop marked steps leaves its totals behind."""
    sent: list = []
    reporter = Reporter(0, sent.append)
    try:
        quiet = reporter.clock
        reporter.pause()
        reporter.resume(sent.append)
        assert reporter.clock is quiet
        for _ in reporter.track(range(3), None, None):
            pass
        assert reporter.clock.totals.steps == 3
        reporter.pause()
        reporter.resume(sent.append)
        assert reporter.clock is not quiet and reporter.clock.totals.steps == 0
    finally:
        reporter.close()


def test_a_run_left_mid_step_leaves_no_model_hook_behind():
    """A framework's step that raised never said the loop paused: the clock still looks
    for DDP models with a hook on every module's forward. The run's end takes that hook
    away, rather than leave it for the rank's life."""
    torch = pytest.importorskip("torch")
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    before = len(hooks)
    reporter = Reporter(0, [].append)
    try:
        reporter.clock.batch_ready()  # (Lightning's batch start; the step then raised)
        assert len(hooks) == before + 1
        reporter.pause()
        reporter.resume([].append)
        assert len(hooks) == before
    finally:
        reporter.close()
