"""SLURM from the kernel: submit a run as a batch job, follow its state, cancel it.

Only SLURM's own commands are used (``sbatch``, ``squeue``, ``scancel``), so whatever
configures them on a login node (``SLURM_CONF``, the user's defaults) applies. The job
state comes from ``squeue``, which works without accounting (``sacct`` does not), asked
for only the fields SLURM itself sets: a job's name or comment, the user's text, is
never read, so it cannot pose as the job's state. ``SlurmLauncher`` lets a ``Job``
follow a batch job the way it follows a local torchrun: wait for it to end, stop it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import NbddpError
from .._run.config import RunConfig
from .._run.groups.shape import rank_environment
from .._run.records import folders, records_root
from .._wire.rundir import RunDir
from .files import JOB, SBATCH
from .options import SlurmOptions
from .sbatch import submission_sbatch_text

logger = logging.getLogger(__name__)

_POLL_INTERVAL = 1.0  # squeue calls while the job is queued or running
_STOP_POLL_INTERVAL = 0.2
_CLEAN_END_WAIT = 30.0  # every rank returned: the job ends by itself within this
_CANCEL_WAIT = 120.0
_COMMAND_TIMEOUT = 60.0
_COMPLETING_TRIES, _COMPLETING_PAUSE = 10, 0.3
# States in which a job may still have processes (squeue's default set, and more).
_ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
           "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED",
           "SPECIAL_EXIT", "RESV_DEL_HOLD", "POWER_UP_NODE", "UPDATE_DB"}


# How a job ends when SLURM (or someone else) stops it, not its own ranks.
_STOPPED_BY_SLURM = {"CANCELLED": "was cancelled", "TIMEOUT": "reached its time limit",
                     "NODE_FAIL": "lost a node", "PREEMPTED": "was preempted",
                     "OUT_OF_MEMORY": "ran out of memory", "DEADLINE": "missed its deadline",
                     "BOOT_FAIL": "could not boot its nodes"}


# squeue's fields for a job's status: each whole (":0"), ended by "|", which none can hold.
_FIELDS = ("State", "Reason", "RestartCnt", "exit_code", "NodeList")
_FORMAT = ",".join(f"{name}:0|" for name in _FIELDS)


@dataclass(frozen=True)
class JobStatus:
    """What ``squeue`` says of a job: the state, why it waits, where it runs."""

    state: str
    reason: str = ""
    """Why a pending job waits (``Priority``, ``JobHeldUser``...); empty if SLURM says none."""
    nodes: str = ""
    exit_code: int | None = None
    restarts: int = 0
    """How many times SLURM has requeued the job (``Restarts``); each requeue runs it again."""

    @property
    def ended(self) -> bool:
        return self.state not in _ACTIVE

    def describe(self, job_id: str) -> str:
        """A line for the notebook, e.g. ``SLURM job 12 is queued (Priority)``."""
        if self.state == "PENDING":
            why = f" ({self.reason})" if self.reason else ""
            again = f" again (requeue {self.restarts})" if self.restarts else ""
            return f"SLURM job {job_id} is queued{again}{why}"
        if self.state == "RUNNING":
            return f"SLURM job {job_id} is running on {self.nodes}"
        return f"SLURM job {job_id} is {self.state.lower()}"


def scancel(target: str, *options: str) -> bool:
    """``scancel`` a job or a job step (``JOB.STEP``); whether SLURM took it (a refusal is
    logged)."""
    done = _run("scancel", *options, target)
    if done.returncode != 0:
        logger.warning("nbddp: scancel %s: %s", target, done.stderr.strip())
    return done.returncode == 0


def _run(*args: str, env: dict[str, str] | None = None,
         cwd: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=_COMMAND_TIMEOUT, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise NbddpError(f"{args[0]} not found: submitting to SLURM needs SLURM's commands "
                         "on PATH (run the notebook on a login node)") from None
    except subprocess.TimeoutExpired:
        raise NbddpError(f"{' '.join(args)} did not answer within {_COMMAND_TIMEOUT} s; "
                         "is slurmctld reachable?") from None


def job_status(job_id: str) -> JobStatus:
    done = _run("squeue", "--noheader", f"--jobs={job_id}", "--states=all",
                f"--Format={_FORMAT}")
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return JobStatus("GONE")  # finished long enough ago to be purged
        raise NbddpError(f"squeue --jobs={job_id} failed: {done.stderr.strip()}")
    return parse_status(done.stdout)


def parse_status(text: str) -> JobStatus:
    """``squeue``'s answer for one job (``_FIELDS``, each ended by ``|``) as a JobStatus.
    Its exit status is the job script's wait status: the exit code is its high byte
    (0 for a script killed by a signal, as ``scontrol``'s ``ExitCode=0:9`` says)."""
    lines = text.splitlines()
    if not lines:
        return JobStatus("GONE")  # (squeue knows no such job)
    values = lines[0].split("|")
    if len(values) != len(_FIELDS) + 1 or not values[0]:
        raise NbddpError(f"squeue answered {lines[0]!r}, not {'|'.join(_FIELDS)}|")
    state, reason, restarts, status, nodes = values[:len(_FIELDS)]
    return JobStatus(state, "" if reason == "None" else reason, nodes,
                     int(status) >> 8 if status.isdigit() else None,
                     int(restarts) if restarts.isdigit() else 0)


def kernel_host() -> str:
    """The name ranks on other machines use to reach this kernel (``NBDDP_KERNEL_HOST``
    overrides, e.g. a login node's address on the cluster's network)."""
    return os.environ.get("NBDDP_KERNEL_HOST") or socket.getfqdn()


def submit(run_dir: RunDir, config: RunConfig, options: SlurmOptions) -> str:
    """Write the job's sbatch file and shape into ``run_dir``, ``sbatch`` it; the job id."""
    script = run_dir.path / SBATCH
    script.write_text(submission_sbatch_text(str(run_dir.path), sys.executable, options))
    job_id = sbatch(script, rank_environment(config))
    shape = {"job_id": job_id, "nprocs": config.nprocs, "all_ranks": config.all_ranks,
             "output": config.output}
    run_dir.write_private(run_dir.path / JOB, json.dumps(shape).encode())
    return job_id


def sbatch(script: Path, env: dict[str, str], cwd: str | None = None) -> str:
    """Submit ``script`` with the ranks' environment; the job id."""
    done = _run("sbatch", "--parsable", str(script), env=env, cwd=cwd)
    if done.returncode != 0:
        raise NbddpError(f"sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]


def read_shape(run_dir: RunDir) -> dict[str, Any]:
    """What ``submit`` recorded: the job id, world size, ``all_ranks`` and ``output``."""
    try:
        return json.loads((run_dir.path / JOB).read_text())
    except (OSError, ValueError) as exc:
        raise NbddpError(f"{run_dir.path} is not the run folder of a submitted job "
                         f"({exc})") from None


def find_run_dir(job_id: str) -> RunDir:
    """The run folder of a job submitted from this account (under ``$NBDDP_RUNS_DIR``)."""
    root = records_root()
    for folder in reversed(folders(root)):
        run_dir = RunDir.of_job(folder)
        if not (run_dir.path / JOB).exists():
            continue
        with contextlib.suppress(NbddpError):
            if read_shape(run_dir)["job_id"] == job_id:
                return run_dir
    raise NbddpError(f"no run folder of SLURM job {job_id} in {root}; pass the folder the "
                     "job was submitted with: nbddp.attach(job_id, run_dir)")


def stopped_by_slurm(job_id: str, known: JobStatus | None = None) -> str | None:
    """Why SLURM (or someone else) ended the job, e.g. ``SLURM job 12 reached its time
    limit``; None if it was not stopped so. ``known``: its last status, if that is final
    (otherwise SLURM is asked now)."""
    status = known
    for _ in range(_COMPLETING_TRIES if status is None else 0):
        try:
            status = job_status(job_id)
        except NbddpError:
            return None
        if status.state != "COMPLETING":  # (a cancelled job completes before it says so)
            break
        time.sleep(_COMPLETING_PAUSE)
    if status is None:
        return None
    what = _STOPPED_BY_SLURM.get(status.state)
    if what is None:
        return None
    return f"SLURM job {job_id} {what}" + (f" ({status.reason})" if status.reason else "")


class SlurmLauncher:
    """A submitted job, seen as a ``Job`` sees its launcher: ``wait`` until it has left
    the queue (reporting each state change), ``stop`` it with ``scancel``."""

    def __init__(self, job_id: str, report: Callable[[JobStatus], None]) -> None:
        self.job_id = job_id
        self.status = JobStatus("UNKNOWN")
        self._report = report
        self._wake = threading.Event()
        self._ended = threading.Event()
        self._interval = _POLL_INTERVAL
        self._released = False

    def add_rank(self, pid: int) -> None:
        """Ranks run on other machines: they are stopped through SLURM, not by PID."""

    def stopped_from_outside(self) -> str | None:
        """Why the job ended, if SLURM or someone else stopped it, e.g. a time limit
        (asked of SLURM now if the job has not been seen to end: its ranks' deaths are
        often heard of first)."""
        return stopped_by_slurm(self.job_id, self.status if self._ended.is_set() else None)

    def wait(self) -> int:
        """Poll the job until it has ended (or ``release``); its exit code (0 if SLURM no
        longer knows)."""
        while not self._released:
            try:
                status = job_status(self.job_id)
            except NbddpError as exc:  # a slow or restarting slurmctld: try again
                logger.warning("nbddp: %s", exc)
                status = self.status
            if status != self.status:
                self.status = status
                self._report(status)
            if status.ended:
                self._ended.set()
                return status.exit_code or 0
            self._wake.wait(self._interval)
            self._wake.clear()
        return 0  # released: the job goes on without this kernel

    def release(self) -> None:
        """Stop following the job, and leave it running (a kernel that detached)."""
        self._released = True
        self._wake.set()

    def stop(self, clean: bool = False) -> None:
        """Let a job whose ranks all returned end by itself; cancel any other, and wait
        until it has left the queue, so nothing of it is left running."""
        self._interval = _STOP_POLL_INTERVAL
        self._wake.set()
        if clean and self._ended.wait(_CLEAN_END_WAIT):
            return
        if not self._ended.is_set():
            scancel(self.job_id)
        if not self._ended.wait(_CANCEL_WAIT):
            logger.warning("nbddp: SLURM job %s still in the queue %s s after scancel",
                           self.job_id, _CANCEL_WAIT)

