"""Runs that survive what clusters do: torchrun's own restarts, and a clean environment.

Real launches: a rank that raises, or is killed, on the first attempt, and a run that
fails on every attempt; the restart is said in the output, counted on the job, and every
attempt's output is kept. Then ``%%ddp --max-restarts`` in a real kernel, the option's
checks and its place in exported and submitted sbatch files; and ranks started from a
kernel inside a SLURM allocation, which must not inherit the allocation's variables.
"""

from __future__ import annotations

import io
import time

import pytest

import nbddp
from nbddp._local.launcher import torchrun_command
from nbddp._run.config import RunConfig
from nbddp._run.diagnosis.root_cause import describe, first_cause
from nbddp._run.groups.group import LauncherExited, RankGroup
from nbddp._run.groups.shape import GroupShape, without_allocation
from nbddp._run.records import Records
from nbddp._run.supervisor import Supervisor
from nbddp._slurm.options import Slurm
from nbddp._slurm.sbatch import submission_sbatch_text
from nbddp._wire.messages import Disconnected, Failure, Hello, Sequenced
from nbddp._wire.rundir import RunDir

# --- functions the ranks run ---------------------------------------------------------


def fails_first(how: str):
    """Rank 1 fails on the first attempt (raises, or is killed) while rank 0 waits for it;
    the second attempt returns."""
    import os
    import signal

    import torch.distributed as dist

    rank, attempt = dist.get_rank(), nbddp.restart_count()
    print(f"attempt {attempt} on rank {rank}", flush=True)
    dist.barrier()  # both have printed
    if attempt == 0 and rank == 1:
        if how == "raise":
            raise RuntimeError("the first attempt fails")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return attempt


def always_fails():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(f"attempt {nbddp.restart_count()} fails too")
    dist.barrier()


# --- launches ------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_rank_that_fails_once_is_restarted_and_the_run_returns(how, capsys):
    job = nbddp.launch(fails_first, 2, args=(how,), max_restarts=1, wait=False)
    assert job.result() == 1  # the value of the second attempt
    assert job.restarts == 1
    cause = ("rank 1 raised RuntimeError: the first attempt fails" if how == "raise"
             else "rank 1 exited without raising an exception")
    assert f"restart 1 of 1: {cause}" in capsys.readouterr().out
    logs = job.logs  # every attempt's output is kept
    assert "attempt 0 on rank 0" in logs[0] and "attempt 1 on rank 0" in logs[0]
    assert "attempt 0 on rank 1" in logs[1] and "attempt 1 on rank 1" in logs[1]
    if how == "raise":
        assert "RuntimeError: the first attempt fails" in logs[1]


def test_a_run_that_fails_on_every_attempt_says_how_many_were_made():
    job = nbddp.launch(always_fails, 2, max_restarts=2, wait=False)
    with pytest.raises(nbddp.WorkerError) as caught:
        job.result()
    error = caught.value
    assert error.rank == 1 and "ValueError: attempt 2 fails too" in str(error)  # the last
    assert error.attempts == 3 and job.restarts == 2
    assert "on the last of 3 attempts" in str(error)
    assert error.earlier == ["rank 1 raised ValueError: attempt 0 fails too",
                             "rank 1 raised ValueError: attempt 1 fails too"]


def always_failing_attempt(attempt: int) -> list:
    """What the kernel hears of one attempt of ``always_fails``: rank 0's broken barrier
    first (reader threads may deliver it before rank 1's report), then rank 1's
    ValueError, then both connections closing."""
    broken = "[pair.cc:553] Connection closed by peer [127.0.0.1]:30346"
    raised = f"attempt {attempt} fails too"
    return [Sequenced(0, Hello(0, 100), attempt), Sequenced(0, Hello(1, 101), attempt),
            Sequenced(1, Failure(0, "RuntimeError", "builtins", broken, ""), attempt),
            Sequenced(1, Failure(1, "ValueError", "builtins", raised, ""), attempt),
            Disconnected(0, attempt), Disconnected(1, attempt)]


@pytest.mark.fast
def test_attempts_that_end_before_a_failed_ones_reports_are_gathered_all_count(tmp_path):
    """torchrun may restart, fail again and exit before the kernel has waited for the
    first failed attempt's last reports (quick attempts, a busy kernel): the run still
    ends in the last attempt, with every restart counted and each attempt named by the
    rank that raised, not by the peer whose barrier broke."""
    (tmp_path / "run").mkdir()
    group = RankGroup(2, RunDir(tmp_path / "run"))
    sup = Supervisor(group, RunConfig(nprocs=2, max_restarts=2), Records(tmp_path),
                     io.StringIO(), group.where)
    for event in [*(e for n in range(3) for e in always_failing_attempt(n)),
                  LauncherExited(1)]:
        group.events.put(event)  # (all there before the first failure is looked at)
    try:
        assert sup.watch(time.monotonic() + 30, lambda: None).kind == "failed"
    finally:
        sup.close("failed", "")
    assert sup.attempt.number == 2
    assert describe(first_cause(sup.attempt.failures)) == \
        "rank 1 raised ValueError: attempt 2 fails too"
    assert [describe(cause) for cause in sup.causes] == [
        "rank 1 raised ValueError: attempt 0 fails too",
        "rank 1 raised ValueError: attempt 1 fails too"]


def test_without_restarts_a_failure_ends_the_run():
    with pytest.raises(nbddp.WorkerError) as caught:
        nbddp.launch(always_fails, 2)
    assert caught.value.attempts == 1 and "attempts" not in str(caught.value)


def test_the_cell_magic_restarts_a_cell(kernel):
    kernel.run("%load_ext nbddp").assert_ok()
    run = kernel.run("""%%ddp --nprocs 2 --max-restarts 1
import nbddp
import torch.distributed as dist
if nbddp.restart_count() == 0 and dist.get_rank() == 0:
    raise RuntimeError("first attempt")
dist.barrier()
nbddp.restart_count()
""").assert_ok()
    assert run.result() == "1"
    assert "restart 1 of 1: rank 0 raised RuntimeError: first attempt" in run.stream_text()
    assert kernel.run("import nbddp; nbddp.last_job().restarts").assert_ok().result() == "1"


# --- the option ----------------------------------------------------------------------


@pytest.mark.parametrize("value, error", [(-1, ValueError), (True, TypeError),
                                          (1.5, TypeError)])
def test_max_restarts_is_a_count(value, error):
    with pytest.raises(error, match="max_restarts"):
        RunConfig(nprocs=2, max_restarts=value)
    with pytest.raises(error, match="max_restarts"):
        Slurm(max_restarts=value)
    with pytest.raises(error, match="max_restarts"):
        nbddp.launch(always_fails, 2, max_restarts=value)


def test_torchrun_gets_max_restarts(tmp_path):
    shape = GroupShape.of(RunConfig(nprocs=2, max_restarts=3))
    command = torchrun_command(RunDir(tmp_path), shape, 0)
    assert command[command.index("--max-restarts") + 1] == "3"
    assert shape.handover(GroupShape.of(RunConfig(nprocs=2))) is None  # other ranks


def test_sbatch_files_get_max_restarts(tmp_path):
    def train():
        return 1

    written = nbddp.export(train, tmp_path / "train.py", max_restarts=2)
    assert "--max-restarts 2" in written[1].read_text()
    options = Slurm(nodes=2, max_restarts=4).options(2, 0)
    assert "--max-restarts 4" in submission_sbatch_text(str(tmp_path), "python", options)


def test_launch_and_slurm_must_agree_on_max_restarts():
    with pytest.raises(ValueError, match="disagrees"):
        nbddp.launch(always_fails, 2, max_restarts=1, cluster=Slurm(max_restarts=2))


# --- a clean environment ----------------------------------------------------------------

ALLOCATION = {  # what a kernel inherits on a compute node of an allocation
    "SLURM_JOB_ID": "424242", "SLURM_NTASKS": "8", "SLURM_MEM_PER_CPU": "100",
    "SLURM_CPU_BIND": "quiet,mask_cpu:0x1", "SBATCH_PARTITION": "nowhere",
    "SRUN_CPUS_PER_TASK": "3", "PMI_RANK": "5", "PMIX_RANK": "5",
}


def test_the_allocations_variables_are_left_out_and_slurm_conf_kept():
    env = {**ALLOCATION, "SLURM_CONF": "/etc/slurm/slurm.conf", "HOME": "/home/me"}
    assert without_allocation(env) == {"SLURM_CONF": "/etc/slurm/slurm.conf",
                                       "HOME": "/home/me"}


def environment(names):
    import os

    return {name: os.environ.get(name) for name in names}


def test_local_ranks_do_not_see_the_kernels_allocation(monkeypatch):
    for name, value in ALLOCATION.items():
        monkeypatch.setenv(name, value)
    names = [*ALLOCATION, "SLURM_FOR_ME"]
    seen = nbddp.launch(environment, 2, args=(names,), env={"SLURM_FOR_ME": "asked for"})
    assert seen == {**dict.fromkeys(ALLOCATION), "SLURM_FOR_ME": "asked for"}


def test_a_session_cell_refuses_max_restarts():
    from types import SimpleNamespace

    from nbddp._magic import _session_conflicts

    cell = {"nprocs": None, "gpus": None, "backend": None, "init": True, "max_restarts": 1}
    session = SimpleNamespace(config=RunConfig(nprocs=2))
    assert _session_conflicts(cell, [], session) == ["--max-restarts"]
    assert _session_conflicts(cell, ["--slurm"], session) == ["--max-restarts", "--slurm"]
    assert _session_conflicts({**cell, "max_restarts": 0}, [], session) == []
