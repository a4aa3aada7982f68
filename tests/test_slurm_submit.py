"""Submitting from the notebook to a real SLURM cluster (scripts/slurm-up.sh): the job's
output, metrics and result come back to the kernel; interrupts, timeouts and failures
stop it; a restarted kernel re-attaches to it.

The cluster has two nodes on this machine. Job processes are children of slurmd, not of
pytest, so each test checks that its job has left the queue when the cell returns.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import nbddp

from .conftest import wait_until
from .kernel_driver import Kernel
from .slurm import job_ended, job_info, slurm

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.waits]

JOB_ID = re.compile(r"submitted SLURM job (\d+)")


def job_id_in(text: str, jobs: list[str]) -> str:
    match = JOB_ID.search(text)
    assert match, f"no job id in:\n{text}"
    jobs.append(match.group(1))
    return match.group(1)


def setup_cell(slurm_env: dict[str, str], **extra: str) -> str:
    """The kernel's first cell: SLURM's config (and more variables), nbddp, the magic."""
    variables = {"SLURM_CONF": slurm_env["SLURM_CONF"], **extra}
    return f"import os\nos.environ.update({variables!r})\nimport nbddp\n%load_ext nbddp"


@pytest.fixture(scope="module")
def cluster_kernel(slurm_env, tmp_path_factory):
    k = Kernel(tmp_path_factory.mktemp("slurm-kernel"))
    try:
        k.run(setup_cell(slurm_env)).assert_ok()
        yield k
    finally:
        k.shutdown()


CELL = """
%%ddp --slurm --nodes 2 --nprocs 1 --time 00:05:00 --cpus-per-task 1 --out total
import torch, torch.distributed as dist
for step in nbddp.progress(range(5), desc="train"):
    nbddp.log(step=step, loss=float(step + dist.get_rank()))
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
if dist.get_rank() == 0:
    print(f"rank 0 sees {total.item()} from {dist.get_world_size()} ranks", flush=True)
nodes = [None] * dist.get_world_size()
dist.all_gather_object(nodes, os.environ["SLURMD_NODENAME"])
sorted(nodes)
"""


def test_a_cell_submitted_to_slurm_streams_its_output_and_returns_rank0s_value(
        cluster_kernel, slurm_env, jobs):
    run = cluster_kernel.run(CELL, timeout=120).assert_ok()
    out = run.stream_text()
    job_id = job_id_in(out, jobs)
    assert f"SLURM job {job_id} is running on n[1-2]" in out, run.describe()
    assert "rank 0 sees 3.0 from 2 ranks" in out  # (0 + 1) + (1 + 1): both nodes took part
    assert run.result() == "['n1', 'n2']"  # rank 0's trailing expression
    assert job_ended(slurm_env, job_id)  # the cell returns once the job has left the queue
    assert job_info(slurm_env, job_id)["JobState"] == "COMPLETED"
    check = cluster_kernel.run("total.item(), nbddp.last_job().history[-1]").assert_ok()
    assert check.result() == "(3.0, {'step': 4, 'ranks': 2, 'loss': 4.5})"
    split = cluster_kernel.run("[info['step_split'] is not None and info['step_split']"
                               "['collectives'] for info in nbddp.last_job().ranks.values()]")
    assert split.assert_ok().result() == "[None, None]"  # timed on both nodes; no DDP model


FILES_ONLY = """
os.environ["NBDDP_KERNEL_HOST"] = "unreachable.invalid"  # the ranks cannot connect back
def count(n):
    import torch.distributed as dist
    for step in range(n):
        nbddp.log(step=step, rank=float(dist.get_rank()))
    print("counted", n, flush=True)
    return n * dist.get_world_size()

job = nbddp.launch(count, nprocs=2, args=(3,), cluster=nbddp.Slurm(nodes=1), wait=False)
value = job.result()
del os.environ["NBDDP_KERNEL_HOST"]
value, job.history, job.logs[1]
"""


def test_ranks_that_cannot_reach_the_kernel_report_through_files(cluster_kernel, slurm_env,
                                                                 jobs):
    run = cluster_kernel.run(FILES_ONLY, timeout=120).assert_ok()
    job_id = job_id_in(run.stream_text(), jobs)
    assert "counted 3" in run.stream_text(), run.describe()
    value, history, rank1_log = eval(run.result())  # noqa: S307 - our own repr
    assert value == 6
    assert history == [{"step": s, "ranks": 2, "rank": 0.5} for s in range(3)]
    assert "cannot reach the notebook kernel" in rank1_log
    assert job_ended(slurm_env, job_id)


FAILING = """
def fails_on_rank_1():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("shard 1 is corrupt")
    dist.barrier()

try:
    nbddp.launch(fails_on_rank_1, nprocs=1, cluster=nbddp.Slurm(nodes=2))
except nbddp.WorkerError as error:
    caught = error
print("rank", caught.rank, "|", caught.summary, "|", type(caught.__cause__).__name__)
print(caught.traceback)
"""


def test_a_failing_rank_comes_back_as_worker_error(cluster_kernel, slurm_env, jobs):
    run = cluster_kernel.run(FAILING, timeout=120).assert_ok()
    out = run.stream_text()
    job_id = job_id_in(out, jobs)
    assert "rank 1 | raised ValueError: shard 1 is corrupt | ValueError" in out, run.describe()
    assert 'raise ValueError("shard 1 is corrupt")' in out  # the remote traceback's line
    assert job_ended(slurm_env, job_id)


QUEUED = """
def quick():
    return "released"

job = nbddp.launch(quick, nprocs=1, cluster=nbddp.Slurm(sbatch=["--hold"]), wait=False)
"""


def test_a_queued_job_shows_why_it_waits_then_runs(cluster_kernel, slurm_env, jobs):
    run = cluster_kernel.run(QUEUED).assert_ok()
    job_id = job_id_in(run.stream_text(), jobs)
    asking = "job.state.status, job.state.message, job.done()"
    wait_until(lambda: cluster_kernel.run(asking).result() == "('queued', 'JobHeldUser', False)",
               timeout=30, interval=0.5)
    assert f"SLURM job {job_id} is queued (JobHeldUser)" in run.stream_text()  # under its cell
    slurm(slurm_env, "scontrol", "release", job_id)
    assert cluster_kernel.run("job.result()", timeout=120).assert_ok().result() == "'released'"
    assert f"SLURM job {job_id} is running" in run.stream_text()
    assert job_ended(slurm_env, job_id)


SLOW = """
%%ddp --slurm --nprocs 2
import time
print("training", flush=True)
time.sleep(600)
"""


def test_interrupting_the_cell_cancels_the_job(slurm_env, jobs, fresh_kernel):
    fresh_kernel.run(setup_cell(slurm_env)).assert_ok()
    run = fresh_kernel.submit(SLOW)
    run.wait_for_output("training", timeout=120)
    job_id = job_id_in(run.stream_text(), jobs)
    fresh_kernel.km.interrupt_kernel()
    run.finish(timeout=120)
    assert run.error()["ename"] == "KeyboardInterrupt", run.describe()
    assert job_ended(slurm_env, job_id)  # scancel'ed, and gone, when the cell returns
    assert job_info(slurm_env, job_id)["JobState"] == "CANCELLED"
    assert fresh_kernel.run("1 + 1").result() == "2"


def test_a_timeout_cancels_the_job(slurm_env, jobs, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])

    def sleeps() -> None:
        import time

        time.sleep(600)

    job = nbddp.launch(sleeps, nprocs=1, cluster=nbddp.Slurm(), timeout=40, wait=False)
    assert job.cluster_job_id is not None
    jobs.append(job.cluster_job_id)
    with pytest.warns(DeprecationWarning, match="Job.slurm_job_id is now Job.cluster_job_id"):
        assert job.slurm_job_id == job.cluster_job_id  # (the older name still reads it)
    stacks = wait_until(lambda: (now := job.stacks()).get(0, "").startswith(  # on demand,
        "rank 0: in sleeps (test_slurm_submit.py, line ") and now, timeout=30)  # over the channel
    assert "    time.sleep(600)" in stacks[0], stacks  # its source line, from this file
    assert job.hang_report().splitlines()[1:] == ["rank 0: has entered no collective yet"]
    with pytest.raises(TimeoutError, match="did not finish within 40") as caught:
        job.result()
    assert caught.value.stacks[0].startswith("rank 0: in sleeps (")  # taken before scancel
    assert "rank 0: has entered no collective yet" in caught.value.hang_report
    assert job_ended(slurm_env, job.cluster_job_id)
    assert job_info(slurm_env, job.cluster_job_id)["JobState"] == "CANCELLED"


RESUMABLE = """
def waits_for(flag, steps):
    import pathlib, time
    for step in range(steps):
        nbddp.log(step=step, loss=1.0 / (step + 1))
    print("waiting for", flag, flush=True)
    while not pathlib.Path(flag).exists():
        time.sleep(0.1)
    print("going on", flush=True)
    return "finished after the restart"

job = nbddp.launch(waits_for, nprocs=2, args=({flag!r}, 4), cluster=nbddp.Slurm(nodes=1),
                   wait=False)
"""


def test_a_restarted_kernel_reattaches_to_its_job(slurm_env, jobs, fresh_kernel, tmp_path):
    flag = tmp_path / "go-on"
    fresh_kernel.run(setup_cell(slurm_env)).assert_ok()
    run = fresh_kernel.run(RESUMABLE.format(flag=str(flag))).assert_ok()
    job_id = job_id_in(run.stream_text(), jobs)
    wait_until(lambda: "waiting for" in fresh_kernel.run("job.logs[0]").result(), timeout=120,
               interval=0.5)

    def under_its_cell():  # rank 0's output: the cell's tail shows it soon after the log
        fresh_kernel.run("1")  # takes in the kernel's messages, the cell's late output too
        return f"waiting for {flag}" in run.stream_text()

    wait_until(under_its_cell, timeout=10, interval=0.2)

    fresh_kernel.km.restart_kernel(now=True)
    fresh_kernel.kc.wait_for_ready(timeout=60)
    assert not job_ended(slurm_env, job_id)  # the job outlives the kernel
    fresh_kernel.run(setup_cell(slurm_env)).assert_ok()
    attached = fresh_kernel.submit(f"job = nbddp.attach({job_id!r})\nvalue = job.result()\n"
                                   "value, job.history")
    attached.wait_for_output(f"waiting for {flag}", timeout=60)  # earlier output, shown again
    flag.touch()
    attached.finish(timeout=120).assert_ok()
    assert "going on" in attached.stream_text()
    value, history = eval(attached.result())  # noqa: S307 - our own repr
    assert value == "finished after the restart"
    assert [row["step"] for row in history] == [0, 1, 2, 3]
    assert job_ended(slurm_env, job_id)


def test_bad_slurm_requests_fail_before_anything_runs(slurm_env, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
    with pytest.raises(ValueError, match="nodes"):
        nbddp.Slurm(nodes=0)
    with pytest.raises(ValueError, match="cpus_per_task"):
        nbddp.Slurm(cpus_per_task=0)
    with pytest.raises(TypeError, match="list of lines"):
        nbddp.Slurm(sbatch="--account=proj")
    with pytest.raises(ValueError, match="GPUs per node"):
        nbddp.launch(print, cluster=nbddp.Slurm(), gpus=[0, 1])
    with pytest.raises(nbddp.NbddpError, match="sbatch refused the job: .*partition"):
        nbddp.launch(print, cluster=nbddp.Slurm(partition="no-such-partition"))
    with pytest.raises(nbddp.NbddpError, match="no run folder of SLURM job 999999"):
        nbddp.attach("999999")


def test_a_job_whose_script_cannot_start_says_why(slurm_env, jobs, monkeypatch, tmp_path):
    """The batch job runs, but the ranks never start: the error shows the job's output."""
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'no torch on this node' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(broken))
    job = nbddp.launch(print, cluster=nbddp.Slurm(), wait=False)
    jobs.append(job.cluster_job_id)
    with pytest.raises(nbddp.NbddpError, match="no torch on this node"):
        job.result(timeout=120)
    assert job_ended(slurm_env, job.cluster_job_id)
    assert Path(job.records, "job.sbatch").read_text().count(str(broken)) == 1
    assert not Path(job.records, "payload.pkl").exists()  # the secrets go, the records stay


def test_a_job_cancelled_outside_the_notebook_says_so(slurm_env, jobs, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])

    def sleeps() -> None:
        import time

        print("sleeping", flush=True)
        time.sleep(600)

    job = nbddp.launch(sleeps, nprocs=1, cluster=nbddp.Slurm(), wait=False)
    jobs.append(job.cluster_job_id)
    wait_until(lambda: "sleeping" in job.logs[0], timeout=120, interval=0.2)
    slurm(slurm_env, "scancel", job.cluster_job_id)
    with pytest.raises(nbddp.NbddpError, match=f"SLURM job {job.cluster_job_id} was cancelled"):
        job.result(timeout=120)
    assert job_ended(slurm_env, job.cluster_job_id)


def sees_its_job(names):
    import os

    return {name: os.environ.get(name) for name in names}


def test_a_kernel_inside_an_allocation_submits_a_job_that_runs(slurm_env, jobs, monkeypatch):
    """A Jupyter server on a compute node passes its allocation's variables to the kernel.
    They must not reach the job: there, srun refuses SLURM_MEM_PER_CPU beside the job's
    own --mem, and sbatch would take SBATCH_PARTITION for the new job."""
    from .test_restarts import ALLOCATION

    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
    for name, value in ALLOCATION.items():
        monkeypatch.setenv(name, value)
    job = nbddp.launch(sees_its_job, nprocs=1, args=(["SLURM_JOB_ID", "SLURM_MEM_PER_CPU"],),
                       cluster=nbddp.Slurm(sbatch=["--mem=64M"], time="00:05:00"), wait=False)
    assert job.cluster_job_id is not None
    jobs.append(job.cluster_job_id)
    assert job.result(timeout=120) == {"SLURM_JOB_ID": job.cluster_job_id,
                                       "SLURM_MEM_PER_CPU": None}


def test_a_submitted_job_restarts_a_failed_rank(slurm_env, jobs, monkeypatch):
    """torchrun's restarts on the nodes: the mailboxes carry both attempts, the kernel
    keeps the second one's messages apart from the first's."""
    from .test_restarts import fails_first

    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
    job = nbddp.launch(fails_first, nprocs=2, args=("raise",), wait=False,
                       cluster=nbddp.Slurm(time="00:05:00", max_restarts=1))
    assert job.cluster_job_id is not None
    jobs.append(job.cluster_job_id)
    assert job.result(timeout=180) == 1
    assert job.restarts == 1
    assert "attempt 0 on rank 0" in job.logs[0] and "attempt 1 on rank 0" in job.logs[0]
