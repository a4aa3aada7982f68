"""The single-machine SLURM test cluster (scripts/slurm-up.sh) really schedules jobs.

Needs the cluster up: ``bash scripts/slurm-up.sh`` (root, Debian), which writes
``$NBDDP_SLURM_DIR/env`` (default /tmp/nbddp-slurm/env) with the SLURM_CONF to use; the
tests skip themselves where it is not up. Job processes are children of slurmd, not of
pytest, so every test waits until its jobs and their processes are gone.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import wait_until

pytestmark = pytest.mark.slurm

SLURM_DIR = Path(os.environ.get("NBDDP_SLURM_DIR", "/tmp/nbddp-slurm"))


def _load_env() -> dict[str, str]:
    """The variables ``$NBDDP_SLURM_DIR/env`` exports (``export NAME=VALUE`` lines)."""
    env = {}
    for line in (SLURM_DIR / "env").read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, value = words[1].split("=", 1)
            env[name] = value
    return env


def _unavailable() -> str | None:
    """Why the cluster cannot be used, or None when it can."""
    if shutil.which("sbatch") is None:
        return "no sbatch on PATH (bash scripts/slurm-up.sh installs and starts SLURM)"
    if not (SLURM_DIR / "env").is_file():
        return f"{SLURM_DIR}/env missing: the test cluster is not up (bash scripts/slurm-up.sh)"
    try:
        probe = subprocess.run(["sinfo", "-h"], env={**os.environ, **_load_env()},
                               capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo failed: {exc}"
    if probe.returncode != 0:
        return f"sinfo failed (cluster down? bash scripts/slurm-up.sh): {probe.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    return {**os.environ, **_load_env()}


def slurm(env: dict[str, str], *args: str, timeout: float = 60) -> str:
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args} failed ({done.returncode}): {done.stderr}"
    return done.stdout


def job_info(env: dict[str, str], job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (sacct needs accounting, which this cluster lacks)."""
    text = slurm(env, "scontrol", "show", "job", "--oneliner", job_id)
    return dict(re.findall(r"(\w[\w/:]*)=(\S*)", text))


def job_ended(env: dict[str, str], job_id: str) -> bool:
    """The job left the queue: finished, failed or cancelled, and done completing."""
    done = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i"], env=env,
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0 and "Invalid job id" in done.stderr:
        return True  # already purged from slurmctld's memory (MinJobAge)
    assert done.returncode == 0, f"squeue failed ({done.returncode}): {done.stderr}"
    return not done.stdout.strip()


@pytest.fixture
def jobs(slurm_env):
    """Job ids a test submits; any still queued at the end are cancelled, and waited for."""
    submitted: list[str] = []
    yield submitted
    for job_id in submitted:
        if not job_ended(slurm_env, job_id):
            slurm(slurm_env, "scancel", job_id)
    for job_id in submitted:
        wait_until(lambda job_id=job_id: job_ended(slurm_env, job_id), timeout=60, interval=0.2)


def start_time(pid: int) -> str | None:
    """The process's start time (to tell it from a later one given the same PID)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(pid: int, started: str) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X") and start_time(pid) == started


def submit(env: dict[str, str], jobs: list[str], *args: str, timeout: float = 60) -> str:
    out = slurm(env, "sbatch", "--parsable", *args, timeout=timeout)
    job_id = out.strip().split(";")[0]
    jobs.append(job_id)
    return job_id


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
