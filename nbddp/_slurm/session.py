"""A session's ranks as one SLURM job: nodes held once, a cell run on them in milliseconds.

The job runs torchrun on every node (c10d rendezvous on the first one); its ranks reach
the kernel's TCP channel (``_run.session.remote``), named in the session's run folder on
the shared filesystem with the key beside it (both 0600, the folder 0700: only the user
who started the session can reach it). The kernel stops them all by cancelling the job
(or its job step). Closing the channel
makes the ranks at rest exit, so a kernel that dies, however it dies, ends the job too.
Each change of the job's state is said once: while the session starts (``take_unsaid``),
or in the cell that waits for a replacement job (``SessionJobHooks``).

The ranks outlive their kernel for a grace period (by default, as long as the job runs):
at its exit the kernel only detaches, and a new kernel attaches (``attached``) with what
the session's folder keeps: the job and the session's shape (``SessionRecord``), and the
key. The folder and its files are the user's alone, so no one else can attach.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from .._errors import NbddpError
from .._run.config import Output
from .._run.groups.group import GroupHooks
from .._run.groups.shape import GroupShape
from .._run.records import Records, folders, records_root
from .._run.session.remote import RemoteSessionGroup
from .._wire.handshake import new_key
from .._wire.rundir import RunDir, read_own_key
from .files import NODE_EPILOG, SBATCH, SESSION
from .follow import show_job_state
from .launcher import JobStatus, SlurmLauncher, job_status, kernel_host, sbatch
from .options import SlurmOptions
from .sbatch import node_epilog_text, session_sbatch_text
from .step import Allocation, AttachedStep, JobStep

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class SessionRecord:
    """What a kernel that attaches needs to know of a session: its job, its shape, and
    the session's own settings (kept in the folder's ``session.json``)."""

    job_id: str
    options: SlurmOptions
    nprocs: int
    backend: str | None
    init: bool
    timeout: float | None
    output: Output
    grace: float | None
    started: float
    """When the job was submitted (seconds since the epoch)."""
    step: str | None = None
    """The job step's name, where the session runs in the kernel's allocation."""

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def read(cls, run_dir: RunDir) -> SessionRecord:
        fields = json.loads((run_dir.path / SESSION).read_text())
        options = fields.pop("options")
        options["extra"] = tuple(options["extra"])
        return cls(options=SlurmOptions(**options), **fields)


@dataclass(frozen=True)
class JobChanged:
    """Kernel-side event: the session's job changed state (the ``number``-th change)."""

    number: int
    status: JobStatus


class SlurmSessionGroup(RemoteSessionGroup):
    """A session's ranks as one SLURM job: ``submit`` one, or attach to a running one."""

    launcher_name = "the SLURM job"

    def __init__(self, shape: GroupShape, options: SlurmOptions, grace: float | None,
                 run_dir: RunDir) -> None:
        super().__init__(shape, run_dir, options.nodes)
        self.options, self.grace = options, grace
        self.step_of: Allocation | None = None
        """The kernel's allocation, where the ranks run as a job step of it."""
        self.status = JobStatus("UNKNOWN")
        self._changes: list[JobStatus] = []
        self._said = 0  # changes shown in the notebook so far
        self._follower: SlurmLauncher | JobStep | AttachedStep | None = None

    @property
    def outlives_kernel(self) -> bool:
        return self.grace != 0

    @classmethod
    def start(cls, shape: GroupShape, options: SlurmOptions, grace: float | None,
              settings: dict[str, Any]) -> SlurmSessionGroup:
        """Listen, and start a new session's ranks: a job step where the kernel runs in
        an allocation (``allocation``), else a batch job of their own (``settings``: the
        session's own, kept for a kernel that attaches: ``timeout``, ``output``)."""
        allocation = Allocation.here()
        group = cls(shape, options, grace, RunDir.of_job(Records.create().path))
        try:
            group.run_dir.write_private(group.run_dir.key, new_key())
            epilog = group.run_dir.path / NODE_EPILOG
            group.run_dir.write_private(epilog, node_epilog_text().encode())
            epilog.chmod(0o700)
            group._listen(kernel_host())
            step = None
            if allocation is not None:
                step = group._start_step(allocation)
                job_id = allocation.job_id
            else:
                job_id = group._submit()
            group.run_dir.write_private(group.run_dir.path / SESSION, SessionRecord(
                job_id, options, shape.nprocs, shape.backend, shape.init, grace=grace,
                started=time.time(), step=step, **settings).to_json())
        except BaseException:
            group.stop()
            group.close()
            raise
        return group

    def _submit(self) -> str:
        script = self.run_dir.path / SBATCH
        script.write_text(session_sbatch_text(
            str(self.run_dir.path), self.shape.python, self.options, self.shape.prepare,
            self.grace))
        job_id = sbatch(script, dict(self.shape.env), self.shape.cwd)
        self._follow(job_id)
        return job_id

    def _start_step(self, allocation: Allocation) -> str:
        """``srun`` in the kernel's allocation; the step's name."""
        step = JobStep(allocation, self.run_dir, self.shape, self.options, self.grace)
        self.cluster_job_id, self.step_of = allocation.job_id, allocation
        self.where = f"SLURM allocation {allocation.job_id}"
        self.status = JobStatus("RUNNING", nodes=allocation.nodelist)
        self._follower = step
        self._follow_launcher(step)
        return step.name

    @classmethod
    def attached(cls, shape: GroupShape, run_dir: RunDir,
                 record: SessionRecord) -> SlurmSessionGroup:
        """Listen anew for the ranks of a running session's job, which connect to the
        new address as soon as their last kernel has gone."""
        group = cls(shape, record.options, record.grace, run_dir)
        try:
            group._listen(kernel_host())
            if record.step is None:
                group._follow(record.job_id)
            else:
                group.cluster_job_id = record.job_id
                group.where = f"SLURM allocation {record.job_id}"
                group._follower = AttachedStep(record.job_id, record.step)
                group._follow_launcher(group._follower)
        except BaseException:
            group.detach()
            raise
        return group

    def _follow(self, job_id: str) -> None:
        self.cluster_job_id, self.where = job_id, f"SLURM job {job_id}"
        self._follower = SlurmLauncher(job_id, self._job_changed)
        self._follow_launcher(self._follower)

    def _release(self) -> None:
        if self._follower is not None:
            self._follower.release()

    def _job_changed(self, status: JobStatus) -> None:
        with self._lock:
            self.status = status
            self._changes.append(status)
            number = len(self._changes)
        self._put(JobChanged(number, status))

    def take_unsaid(self) -> list[str]:
        """Lines for the changes of the job's state not yet shown, now taken as shown."""
        with self._lock:
            unsaid, self._said = self._changes[self._said:], len(self._changes)
        return [f"nbddp: {status.describe(self.cluster_job_id or '?')}" for status in unsaid]

    def hooks(self, supervisor: Any) -> GroupHooks:
        return SessionJobHooks(supervisor, self)


class SessionJobHooks(GroupHooks):
    """A cell on a session's job: a job that still waits for its nodes (the replacement
    of one that was lost) shows its state in the cell, as the session's start does."""

    def __init__(self, supervisor: Any, group: SlurmSessionGroup) -> None:
        super().__init__(supervisor)
        self.group = group
        supervisor.pump.on(JobChanged, self._changed)

    def _changed(self, event: JobChanged) -> None:
        for line in self.group.take_unsaid():
            self.supervisor.output.write(line + "\n")
        show_job_state(self.supervisor, event.status)


def running_sessions(job_id: str | None = None) -> list[tuple[SessionRecord, RunDir]]:
    """This account's session jobs that still run (under ``$NBDDP_RUNS_DIR``), oldest
    first; only ``job_id``'s if given."""
    found = []
    for folder in folders(records_root()):
        run_dir = RunDir.of_job(folder)
        try:
            read_own_key(folder)  # (a folder anyone else made or can write to is not)
            record = SessionRecord.read(run_dir)
        except (OSError, ValueError, TypeError):
            continue  # not a session's folder, or not this user's alone
        if job_id is not None and record.job_id != job_id:
            continue
        with contextlib.suppress(NbddpError):
            if _still_runs(record):
                found.append((record, run_dir))
    return found


def _still_runs(record: SessionRecord) -> bool:
    """Whether the session's ranks may still run: its job, or its job step."""
    if record.step is not None:
        return AttachedStep(record.job_id, record.step).running()
    return not job_status(record.job_id).ended
