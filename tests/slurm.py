"""Helpers for tests that use the single-machine SLURM cluster (scripts/slurm-up.sh)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

SLURM_DIR = Path(os.environ.get("NBDDP_SLURM_DIR", "/tmp/nbddp-slurm"))


def load_env() -> dict[str, str]:
    """The variables ``$NBDDP_SLURM_DIR/env`` exports (``export NAME=VALUE`` lines)."""
    env = {}
    for line in (SLURM_DIR / "env").read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, value = words[1].split("=", 1)
            env[name] = value
    return env


def unavailable() -> str | None:
    """Why the cluster cannot be used, or None when it can."""
    if shutil.which("sbatch") is None:
        return "no sbatch on PATH (bash scripts/slurm-up.sh installs and starts SLURM)"
    if not (SLURM_DIR / "env").is_file():
        return f"{SLURM_DIR}/env missing: the test cluster is not up (bash scripts/slurm-up.sh)"
    try:
        probe = subprocess.run(["sinfo", "-h"], env={**os.environ, **load_env()},
                               capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo failed: {exc}"
    if probe.returncode != 0:
        return f"sinfo failed (cluster down? bash scripts/slurm-up.sh): {probe.stderr.strip()}"
    return None


def slurm(env: dict[str, str], *args: str, timeout: float = 60) -> str:
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args} failed ({done.returncode}): {done.stderr}"
    return done.stdout


def resume_node(env: dict[str, str], node: str) -> None:
    """Bring a node that a test took down back into service. With ``ReturnToService=2``
    its slurmd may have registered and returned it already; then SLURM refuses the
    RESUME as an invalid state change, which is fine."""
    done = subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 or "Invalid node state" in done.stderr, (
        f"RESUME of {node} failed ({done.returncode}): {done.stderr}")


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
