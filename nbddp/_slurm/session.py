"""A session's ranks as one SLURM job: nodes held once, a cell run on them in milliseconds.

The job runs torchrun on every node (c10d rendezvous on the first one); its ranks reach
the kernel's TCP channel, named in the session's run folder on the shared filesystem
with the key beside it (both 0600, the folder 0700: only the user who started the
session can reach it), and wait there for each run as a local session's ranks do. The
channel authenticates every frame (``_wire.channel``).

The kernel cannot signal a rank on another node: it interrupts one, and asks for its
stacks, with a message, and stops them all by cancelling the job. Closing the channel
makes the ranks at rest exit, so a kernel that dies, however it dies, ends the job too.
Each change of the job's state is said once: while the session starts (``take_unsaid``),
or in the cell that waits for a replacement job (``SessionJobHooks``).
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass
from typing import Any

from .._errors import NbddpError
from .._run.group import GroupHooks
from .._run.records import Records
from .._run.shape import GroupShape
from .._run.waiting import WaitingGroup
from .._wire.channel import ChannelServer, new_key, tcp_address
from .._wire.messages import Interrupt, ShowStacks, Stacks
from .._wire.rundir import RunDir
from .._wire.stacks import STACKS_WAIT, render
from .launcher import JobStatus, SlurmLauncher, kernel_host, sbatch
from .options import SlurmOptions
from .sbatch import session_sbatch_text

logger = logging.getLogger(__name__)

_OPEN: set[SlurmSessionGroup] = set()
_OPEN_LOCK = threading.Lock()


@atexit.register
def _cancel_open_jobs() -> None:
    """At the kernel's exit, cancel every session job still held (the ranks would end
    by themselves as the channel closes; this also ends one still in the queue)."""
    with _OPEN_LOCK:
        groups = list(_OPEN)
    for group in groups:
        group.stop()
        group.close()


@dataclass(frozen=True)
class JobChanged:
    """Kernel-side event: the session's job changed state (the ``number``-th change)."""

    number: int
    status: JobStatus


class SlurmSessionGroup(WaitingGroup):
    """A session's ranks as the SLURM job submitted now for ``shape`` and ``options``."""

    launcher_name = "the SLURM job"

    def __init__(self, shape: GroupShape, options: SlurmOptions) -> None:
        super().__init__(shape, RunDir.of_job(Records.create().path))
        self.options = options
        self.status = JobStatus("UNKNOWN")
        self._changes: list[JobStatus] = []
        self._said = 0  # changes shown in the notebook so far
        self._stack_calls = 0
        self._stacks: dict[int, Stacks] = {}  # the latest request's answers
        self._stacks_came = threading.Condition(self._lock)
        self._stopped = False
        with _OPEN_LOCK:
            _OPEN.add(self)
        try:
            key = new_key()
            self.run_dir.write_private(self.run_dir.key, key)
            host = _kernel_address()
            self._server = ChannelServer((host, 0), key, self._deliver)
            self.run_dir.write_private(self.run_dir.address,
                                       f"{host} {self._server.port}".encode())
            self._submit()
        except BaseException:
            self.stop()
            self.close()
            raise

    def _submit(self) -> None:
        self.run_dir.sbatch.write_text(session_sbatch_text(
            str(self.run_dir.path), self.shape.python, self.options, self.shape.prepare))
        job_id = sbatch(self.run_dir.sbatch, dict(self.shape.env), self.shape.cwd)
        self.slurm_job_id, self.where = job_id, f"SLURM job {job_id}"
        self._follow_launcher(SlurmLauncher(job_id, self._job_changed))

    def _job_changed(self, status: JobStatus) -> None:
        with self._lock:
            self.status = status
            self._changes.append(status)
            number = len(self._changes)
        self.events.put(JobChanged(number, status))

    def take_unsaid(self) -> list[str]:
        """Lines for the changes of the job's state not yet shown, now taken as shown."""
        with self._lock:
            unsaid, self._said = self._changes[self._said:], len(self._changes)
        return [f"nbddp: {status.describe(self.slurm_job_id or '?')}" for status in unsaid]

    def hooks(self, supervisor: Any) -> GroupHooks:
        return SessionJobHooks(supervisor, self)

    def interrupt(self, ranks: set[int]) -> None:
        """Ask each rank of ``ranks`` to raise ``KeyboardInterrupt`` in the user's code."""
        assert self._server is not None
        for rank in ranks:
            self._server.send(rank, Interrupt())

    def stacks(self, wait: float = STACKS_WAIT) -> dict[int, str]:
        """Every rank's Python stacks, sent back over the channel; a rank that does not
        answer within ``wait`` s (and a moment for the network) is left out."""
        with self._lock:
            self._stack_calls += 1
            call, ranks, self._stacks = self._stack_calls, set(self._pids), {}
        assert self._server is not None
        asked = {rank for rank in ranks if self._server.send(rank, ShowStacks(call))}
        with self._lock:
            self._stacks_came.wait_for(lambda: asked <= set(self._stacks), wait + 1.0)
            answers = dict(self._stacks)
        return {rank: render(answer.dump, answer.main) for rank, answer in sorted(answers.items())
                if answer.dump is not None}

    def _took(self, message: Any) -> bool:
        if not isinstance(message, Stacks):
            return False
        if message.call == self._stack_calls:
            self._stacks[message.rank] = message
            self._stacks_came.notify_all()
        return True

    def stop(self, clean: bool = False) -> None:
        """Cancel the job and wait until it has left the queue (or, ``clean``, let it end
        by itself first: the ranks at rest exit when the channel closes)."""
        super().stop(clean)
        self._stopped = True
        self._forget_when_done()

    def close(self) -> None:
        super().close()
        self._forget_when_done()

    def _forget_when_done(self) -> None:
        """Stopped and closed: nothing is left for the exit hook to end."""
        if self._stopped and self._closed:
            with _OPEN_LOCK:
                _OPEN.discard(self)


def _kernel_address() -> str:
    """The address the ranks connect to: a session cannot run without it."""
    try:
        return tcp_address(kernel_host())
    except ConnectionError as exc:
        raise NbddpError(f"{exc}; a session's ranks must reach the kernel: set "
                         "NBDDP_KERNEL_HOST to this machine's address on the cluster's "
                         "network") from None


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
        state = self.supervisor.state
        if event.status.state == "PENDING":
            state.status, state.message = "queued", event.status.reason
        elif event.status.state == "RUNNING" and state.status == "queued":
            state.status, state.message = "running", f"on {event.status.nodes}"
            self.supervisor.view.touch()  # the time in the queue was no stall
