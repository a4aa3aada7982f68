"""SLURM requeues and the warning before a time limit: runs that outlive their job's run.

On the test cluster (scripts/slurm-up.sh): a job that ``scontrol requeue`` stops half
way is followed through its next run to its result, and a kernel restarted while its
job is requeued attaches to the new run. (A job warned of its time limit, which saves,
calls ``nbddp.requeue()`` and resumes in its next run, is the cluster page's example,
run by test_docs.) Then the pure parts: what the batch script says, ``squeue``'s
restart count, the options' checks, and the stop watcher.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

import nbddp
from nbddp._errors import NbddpError
from nbddp._slurm.launcher import JobStatus, parse_status
from nbddp._slurm.options import SlurmOptions
from nbddp._slurm.sbatch import submission_sbatch_text

from .conftest import wait_until
from .slurm import job_ended, job_info, slurm

pytestmark = pytest.mark.waits  # the waiting lane (tests/conftest.py)

# --- functions the ranks run ---------------------------------------------------------


def waits_to_be_requeued(flag: str):
    """The job's first run waits until SLURM stops it, and raises when it does (so its
    ranks report failures); the next one waits for ``flag`` and returns which run it is."""
    import pathlib
    import signal
    import time

    def stopped(signum, frame):
        print(f"run {run} stopped by SLURM", flush=True)
        raise RuntimeError("SLURM stopped this run")

    run = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    signal.signal(signal.SIGTERM, stopped)
    for step in range(2):
        nbddp.log(step=10 * run + step, loss=1.0)
    print(f"run {run} waiting", flush=True)
    while run == 0 or not pathlib.Path(flag).exists():
        time.sleep(0.1)
    return run


# --- on the test cluster --------------------------------------------------------------


@pytest.mark.slurm
@pytest.mark.slow
def test_a_requeued_job_is_followed_to_its_result(slurm_env, jobs, monkeypatch, tmp_path,
                                                  capfd):
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
    flag = tmp_path / "go-on"
    job = nbddp.launch(waits_to_be_requeued, nprocs=2, args=(str(flag),), wait=False,
                       cluster=nbddp.Slurm(time="00:05:00", requeue=True))
    assert job.cluster_job_id is not None
    jobs.append(job.cluster_job_id)
    wait_until(lambda: "run 0 waiting" in job.logs[0], timeout=120, interval=0.2)
    slurm(slurm_env, "scontrol", "requeue", job.cluster_job_id)
    wait_until(lambda: "run 1 waiting" in job.logs[0], timeout=120, interval=0.2)
    assert not job.done()  # the first run's end was not the run's end
    flag.touch()
    assert job.result(timeout=120) == 1
    assert job.requeues == 1
    assert "run 0 waiting" in job.logs[0]  # both runs' output is kept
    assert "run 0 stopped by SLURM" in job.logs[1]  # it raised: not taken for the run's end
    assert [row["step"] for row in job.history] == [0, 1, 10, 11]
    assert f"SLURM job {job.cluster_job_id} was requeued (requeue 1)" in capfd.readouterr().out
    assert job_ended(slurm_env, job.cluster_job_id)
    assert job_info(slurm_env, job.cluster_job_id)["JobState"] == "COMPLETED"


RUN_AND_WAIT = """
import os
{source}
job = nbddp.launch(waits_to_be_requeued, nprocs=2, args=({flag!r},), wait=False,
                   cluster=nbddp.Slurm(time="00:05:00"))
"""


@pytest.mark.slurm
@pytest.mark.slow
def test_a_restarted_kernel_attaches_to_its_requeued_job(slurm_env, jobs, fresh_kernel,
                                                         tmp_path):
    """The job is requeued while no kernel follows it: attach reads both runs' messages
    and follows the second run (the cluster's default lets a batch job be requeued)."""
    from .test_slurm_submit import job_id_in, setup_cell

    flag = tmp_path / "go-on"
    fresh_kernel.run(setup_cell(slurm_env)).assert_ok()
    source = inspect.getsource(waits_to_be_requeued)  # defined in the notebook
    run = fresh_kernel.run(RUN_AND_WAIT.format(source=source, flag=str(flag))).assert_ok()
    job_id = job_id_in(run.stream_text(), jobs)
    wait_until(lambda: "run 0 waiting" in fresh_kernel.run("job.logs[0]").result(),
               timeout=120, interval=0.5)

    fresh_kernel.km.restart_kernel(now=True)
    fresh_kernel.kc.wait_for_ready(timeout=60)
    slurm(slurm_env, "scontrol", "requeue", job_id)
    fresh_kernel.run(setup_cell(slurm_env)).assert_ok()
    attached = fresh_kernel.submit(f"job = nbddp.attach({job_id!r})\nvalue = job.result()\n"
                                   "value, job.requeues")
    attached.wait_for_output("run 1 waiting", timeout=120)
    flag.touch()
    attached.finish(timeout=120).assert_ok()
    assert eval(attached.result()) == (1, 1)  # noqa: S307 - our own repr
    assert job_ended(slurm_env, job_id)


# --- pure parts -----------------------------------------------------------------------


def test_the_batch_script_asks_for_a_requeue_and_a_warning_only_when_told():
    plain = submission_sbatch_text("/runs/r1", "python", SlurmOptions())
    assert "--requeue" not in plain and "--signal" not in plain and "trap" not in plain
    assert "#SBATCH --open-mode=append" in plain  # a requeued run's output follows
    told = submission_sbatch_text("/runs/r1", "python", SlurmOptions(
        requeue=True, signal_before=300, extra=("--account=proj",)))
    directives = [line for line in told.splitlines() if line.startswith("#SBATCH")]
    assert directives[-3:] == ["#SBATCH --requeue", "#SBATCH --signal=B:USR1@300",
                               "#SBATCH --account=proj"]  # the user's own lines come last
    assert "trap 'echo \"SLURM: the time limit is near\" >>\"$NBDDP_STOP_FILE\"' USR1" in told
    assert 'scontrol requeue "$SLURM_JOB_ID"' in told


def test_the_batch_script_is_valid_bash():
    text = submission_sbatch_text("/runs/a b", "python", SlurmOptions(signal_before=60))
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_squeue_says_how_many_times_a_job_was_requeued():
    status = parse_status("PENDING|BeginTime|1|0||\n")  # (squeue's answers on the test cluster)
    assert (status.state, status.reason, status.restarts, status.exit_code) == (
        "PENDING", "BeginTime", 1, 0)
    assert status.describe("7") == "SLURM job 7 is queued again (requeue 1) (BeginTime)"
    running = parse_status("RUNNING|None|0|0|n[1-2]|\n")
    assert (running.restarts, running.reason, running.nodes) == (0, "", "n[1-2]")
    assert JobStatus("PENDING", "Priority").describe("7") == "SLURM job 7 is queued (Priority)"


def test_a_jobs_exit_code_is_its_scripts():
    """squeue gives the script's wait status: ``exit 3`` is 768; killed by SIGKILL, 9."""
    assert parse_status("FAILED|NonZeroExitCode|0|768|n1|\n").exit_code == 3
    assert parse_status("FAILED|JobLaunchFailure|0|9|n2|\n").exit_code == 0
    assert parse_status("").state == "GONE"
    with pytest.raises(NbddpError, match="squeue answered 'RUNNING n1'"):
        parse_status("RUNNING n1\n")


def test_bad_requeue_options_are_refused():
    with pytest.raises(ValueError, match="signal_before"):
        nbddp.Slurm(signal_before=0)
    with pytest.raises(ValueError, match="signal_before"):
        nbddp.Slurm(signal_before=70000)
    with pytest.raises(TypeError, match="requeue"):
        nbddp.Slurm(requeue="yes")  # type: ignore[arg-type]


def test_requeue_outside_a_slurm_job_says_where_it_works(monkeypatch):
    monkeypatch.delenv("NBDDP_REQUEUE_FILE", raising=False)
    with pytest.raises(RuntimeError, match=r"works in a run submitted to SLURM: launch\(cluster="):
        nbddp.requeue()
    assert nbddp.stop_requested() is False


def sees_a_requeue_request():
    nbddp.requeue()


def test_a_local_rank_that_calls_requeue_fails_clearly():
    with pytest.raises(nbddp.WorkerError, match="RuntimeError: nbddp.requeue.. puts a SLURM"):
        nbddp.launch(sees_a_requeue_request, nprocs=1)


WATCH = """
import time, nbddp
from nbddp._rank.requeue import watch_for_stop
watch_for_stop(lambda: print("told", nbddp.stop_requested(), flush=True))
print("before", nbddp.stop_requested(), flush=True)
time.sleep(30)
"""


def test_the_stop_watcher_sees_the_batch_script_write_into_the_stop_file(tmp_path):
    stop = tmp_path / "stop-requested"
    stop.write_text("")  # the batch script empties it at each run's start
    child = subprocess.Popen([sys.executable, "-c", WATCH], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "NBDDP_STOP_FILE": str(stop)})
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "before False\n"
        with open(stop, "a") as f:
            f.write("SLURM: the time limit is near\n")
        assert child.stdout.readline() == "told True\n"
    finally:
        child.kill()
        child.wait()
