"""The single-machine SLURM test cluster (scripts/slurm-up.sh) really schedules jobs.

Needs the cluster up: ``bash scripts/slurm-up.sh`` (root, Debian), which writes
``$NBDDP_SLURM_DIR/env`` (default /tmp/nbddp-slurm/env) with the SLURM_CONF to use; the
tests skip themselves where it is not up. Job processes are children of slurmd, not of
pytest, so every test waits until its jobs and their processes are gone.
"""

from __future__ import annotations

import shlex

import pytest

from nbddp._slurm.launcher import job_status

from .conftest import wait_until
from .slurm import alive, job_ended, job_info, slurm, start_time, submit

pytestmark = [pytest.mark.slurm, pytest.mark.waits]

def test_two_node_job_runs_on_both_nodes(slurm_env, jobs, tmp_path):
    # Polled with scontrol rather than sbatch --wait, which polls every 2 s, then 10 s.
    job_id = submit(slurm_env, jobs, "--nodes=2", "--ntasks-per-node=1", "--time=2",
                    f"--chdir={tmp_path}", f"--output={tmp_path}/%j.out",
                    "--wrap", "srun sh -c 'echo node=$SLURMD_NODENAME rank=$SLURM_PROCID'")
    wait_until(lambda: job_ended(slurm_env, job_id), timeout=60, interval=0.1)
    info = job_info(slurm_env, job_id)
    assert info["JobState"] == "COMPLETED", info
    assert info["ExitCode"] == "0:0", info
    assert info["NodeList"] == "n[1-2]", info
    # One task per node. Both nodes share this host's hostname, so each task reports the
    # node name its slurmd runs as.
    lines = sorted((tmp_path / f"{job_id}.out").read_text().splitlines())
    assert lines == ["node=n1 rank=0", "node=n2 rank=1"], lines


def test_scancel_stops_a_running_job(slurm_env, jobs, tmp_path):
    pids_file = tmp_path / "pids"
    tmp, final = shlex.quote(f"{pids_file}.tmp"), shlex.quote(str(pids_file))
    # The batch script records its own PID and its child's, then waits.
    script = f"echo $$ >{tmp}; sleep 600 & echo $! >>{tmp}; mv {tmp} {final}; wait"
    job_id = submit(slurm_env, jobs, "--nodes=1", "--time=5", f"--chdir={tmp_path}",
                    f"--output={tmp_path}/%j.out", "--wrap", script)
    wait_until(pids_file.exists, timeout=30, interval=0.1)
    pids = [int(pid) for pid in pids_file.read_text().split()]
    started = {pid: start_time(pid) for pid in pids}
    assert len(pids) == 2 and all(started.values()), f"job processes not running: {pids}"
    assert job_info(slurm_env, job_id)["JobState"] == "RUNNING"

    slurm(slurm_env, "scancel", job_id)
    wait_until(lambda: job_info(slurm_env, job_id)["JobState"] == "CANCELLED",
               timeout=30, interval=0.2)
    # The job is CANCELLED before slurmstepd has finished killing its processes.
    wait_until(lambda: not any(alive(pid, started[pid]) for pid in pids),
               timeout=30, interval=0.1)
    wait_until(lambda: job_ended(slurm_env, job_id), timeout=30, interval=0.2)


def test_a_jobs_own_name_and_comment_cannot_pose_as_its_state(slurm_env, jobs, monkeypatch):
    """``scontrol show job`` prints the job's name before its state and its comment after
    it, unescaped: a job named or commented ``JobState=COMPLETED`` read as completed while
    it ran. nbddp's status does not read them."""
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
    hostile = "x JobState=COMPLETED Reason=None ExitCode=0:0 NodeList=n9"
    job_id = submit(slurm_env, jobs, "--time=2", "--output=/dev/null", "--job-name", hostile,
                    "--comment", hostile, "--wrap", "sleep 600")
    running = wait_until(lambda: (s := job_status(job_id)).state != "PENDING" and s,
                         timeout=30, interval=0.2)
    assert (running.state, running.nodes, running.ended) == ("RUNNING", "n1", False), running
    shown = slurm(slurm_env, "scontrol", "show", "job", "--oneliner", job_id)
    assert f"JobName={hostile} " in shown and f"Comment={hostile} " in shown
    slurm(slurm_env, "scancel", job_id)
    ended = wait_until(lambda: (s := job_status(job_id)).ended and s, timeout=30, interval=0.2)
    assert ended.state in ("CANCELLED", "GONE"), ended
