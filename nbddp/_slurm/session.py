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

The ranks outlive their kernel for a grace period (by default, as long as the job runs):
at its exit the kernel only detaches, and a new kernel attaches (``attached``) with what
the session's folder keeps: the job and the session's shape (``SessionRecord``), and the
key. The folder and its files are the user's alone, so no one else can attach.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import NbddpError
from .._run.config import Output
from .._run.group import GroupHooks
from .._run.records import Records, folders, records_root
from .._run.shape import GroupShape, Handover
from .._run.waiting import WaitingGroup
from .._wire import dataplane
from .._wire.channel import ChannelServer, new_key, tcp_address
from .._wire.dataplane import Packed, shm_root
from .._wire.messages import (
    Assigned,
    Failure,
    Interrupt,
    KeepPayload,
    PayloadKept,
    RankOptions,
    Result,
    Start,
)
from .._wire.rundir import RunDir, address_text, read_own_key
from .._wire.transfer import Outgoing, place_in
from .follow import show_job_state
from .launcher import JobStatus, SlurmLauncher, job_status, kernel_host, sbatch
from .options import SlurmOptions
from .sbatch import node_epilog_text, session_sbatch_text
from .step import Allocation, AttachedStep, JobStep

logger = logging.getLogger(__name__)

_OPEN: set[SlurmSessionGroup] = set()
_OPEN_LOCK = threading.Lock()


@atexit.register
def _leave_open_jobs() -> None:
    """At the kernel's exit, detach from every session job whose ranks wait for another
    kernel, and cancel the others (also one still in the queue)."""
    with _OPEN_LOCK:
        groups = list(_OPEN)
    for group in groups:
        if group.grace != 0 and group.is_ready and group.gone is None:
            group.detach()
        else:
            group.stop()
            group.close()


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
        fields = json.loads(run_dir.session.read_text())
        options = fields.pop("options")
        options["extra"] = tuple(options["extra"])
        return cls(options=SlurmOptions(**options), **fields)


@dataclass(frozen=True)
class JobChanged:
    """Kernel-side event: the session's job changed state (the ``number``-th change)."""

    number: int
    status: JobStatus


class SlurmSessionGroup(WaitingGroup):
    """A session's ranks as one SLURM job: ``submit`` one, or attach to a running one."""

    launcher_name = "the SLURM job"

    def __init__(self, shape: GroupShape, options: SlurmOptions, grace: float | None,
                 run_dir: RunDir) -> None:
        super().__init__(shape, run_dir)
        self.options, self.grace = options, grace
        self.names: tuple[str, ...] | None = None
        """The names rank 0's code has bound, as it says when a kernel attaches."""
        self.step_of: Allocation | None = None
        """The kernel's allocation, where the ranks run as a job step of it."""
        self.status = JobStatus("UNKNOWN")
        self._changes: list[JobStatus] = []
        self._said = 0  # changes shown in the notebook so far
        self._detached = False
        self._follower: SlurmLauncher | JobStep | AttachedStep | None = None
        self._delivery: PayloadDelivery | None = None
        self._started: set[int] = set()  # the ranks sent this run's Start
        self._received: list[Path] = []  # results' data files that came over the channel
        with _OPEN_LOCK:
            _OPEN.add(self)

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
            group.run_dir.write_private(group.run_dir.node_epilog, node_epilog_text().encode())
            group.run_dir.node_epilog.chmod(0o700)
            group._listen()
            step = None
            if allocation is not None:
                step = group._start_step(allocation)
                job_id = allocation.job_id
            else:
                job_id = group._submit()
            group.run_dir.write_private(group.run_dir.session, SessionRecord(
                job_id, options, shape.nprocs, shape.backend, shape.init, grace=grace,
                started=time.time(), step=step, **settings).to_json())
        except BaseException:
            group.stop()
            group.close()
            raise
        return group

    def _submit(self) -> str:
        self.run_dir.sbatch.write_text(session_sbatch_text(
            str(self.run_dir.path), self.shape.python, self.options, self.shape.prepare,
            self.grace))
        job_id = sbatch(self.run_dir.sbatch, dict(self.shape.env), self.shape.cwd)
        self._follow(job_id)
        return job_id

    def _start_step(self, allocation: Allocation) -> str:
        """``srun`` in the kernel's allocation; the step's name."""
        step = JobStep(allocation, self.run_dir, self.shape, self.options, self.grace)
        self.slurm_job_id, self.step_of = allocation.job_id, allocation
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
            group._listen()
            if record.step is None:
                group._follow(record.job_id)
            else:
                group.slurm_job_id = record.job_id
                group.where = f"SLURM allocation {record.job_id}"
                group._follower = AttachedStep(record.job_id, record.step)
                group._follow_launcher(group._follower)
        except BaseException:
            group.detach()
            raise
        return group

    def _listen(self) -> None:
        host = _kernel_address()
        self._server = ChannelServer((host, 0), read_own_key(self.run_dir.path), self._deliver,
                                     inbox=place_in(shm_root(), self.run_dir.path))
        self.run_dir.replace_private(self.run_dir.address, address_text(host, self._server.port))

    # --- the payload, once per node -------------------------------------------------

    def _prepare_start(self, payload: Packed, records: Records, options: RankOptions,
                       handover: Handover) -> Start:
        """The run's Start: a small payload inside it; a larger one goes to each node's
        local rank 0 (``PayloadDelivery``), and each rank's Start names its node's copy.
        A result's data comes back the way the payload went."""
        start = self._start_message(self.run_dir.payload, records, options, handover)
        self._forget_received()
        with self._lock:
            self._started = set()
        inline = self._with_payload_inside(start, payload)
        if inline is not None:
            self._delivery = None
            return inline
        self._delivery = PayloadDelivery(payload, self.run_dir)
        return dataclasses.replace(start, remote=self._delivery.outgoing is not None)

    def _send_start(self, rank: int) -> None:
        assert self._server is not None and self._start is not None
        delivery, hello = self._delivery, self._hellos[rank]
        if delivery is None:
            self._started.add(rank)
            self._server.send(rank, self._start)
            return
        if delivery.cancelled:
            return  # (the run ended before this rank's node had the payload)
        copy = delivery.copies.get(hello.node)
        if copy is not None:
            self._started.add(rank)
            self._server.send(rank, dataclasses.replace(self._start, payload=copy))
        elif hello.local_rank == 0:
            delivery.send_to(self._server, rank)
        # (the node's other ranks get their Start once its rank 0 has kept the payload)

    def _payload_kept(self, kept: PayloadKept) -> None:
        """(Under the lock) A node has the payload: its ranks get their Start. A node that
        had no room maps the copy in the session's folder, written first if the payload
        came over the channel (on a thread of its own: this one reads the channel)."""
        delivery = self._delivery
        if delivery is None or kept.rank not in self._hellos:
            return
        node = self._hellos[kept.rank].node
        if kept.file or delivery.shared is not None:
            self._node_has(delivery, node, kept.file or str(delivery.shared))
        else:
            threading.Thread(target=self._share_for, args=(delivery, node, kept.rank),
                             daemon=True, name="nbddp-payload").start()

    def _node_has(self, delivery: PayloadDelivery, node: str, copy: str) -> None:
        """(Under the lock) ``node`` keeps the payload at ``copy``: its ranks start."""
        delivery.copies[node] = copy
        if len(delivery.copies) == self.options.nodes:
            delivery.release()
        for rank, hello in self._hellos.items():
            if hello.node == node:
                self._send_start(rank)

    def _share_for(self, delivery: PayloadDelivery, node: str, rank: int) -> None:
        """Write the payload into the session's folder for ``node``, which had no room
        for it; a run error naming the node if the folder has none either."""
        try:
            copy = str(delivery.write_shared())
        except OSError as exc:
            why = (f"node {node} has no room for the cell's data (in shared memory or on "
                   f"local disk), and the session's folder has none either: {exc}")
            self.events.put(Failure(rank, "NbddpError", "nbddp", why, why))
            return
        with self._lock:
            self._node_has(delivery, node, copy)

    def _forget_received(self) -> None:
        """Remove the data files of results that came but were never read (a run that
        failed or was interrupted after rank 0 returned)."""
        with self._lock:
            received, self._received = self._received, []
        for path in received:
            path.unlink(missing_ok=True)

    def _follow(self, job_id: str) -> None:
        self.slurm_job_id, self.where = job_id, f"SLURM job {job_id}"
        self._follower = SlurmLauncher(job_id, self._job_changed)
        self._follow_launcher(self._follower)

    @property
    def detached(self) -> bool:
        """This kernel left the job to another (``detach``)."""
        return self._detached

    def detach(self) -> None:
        """Leave the job running for a kernel to attach: stop following it, close the
        channel and remove its address (the ranks wait for another), keep the key. From
        then on ``stop`` and ``close`` leave the job alone (a run that ends as the
        channel closes must not cancel it)."""
        self._detached = True
        if self._follower is not None:
            self._follower.release()
        if self._server is not None:
            self._server.close()
        self.run_dir.address.unlink(missing_ok=True)
        self._forget()

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
        """Ask each rank of ``ranks`` to raise ``KeyboardInterrupt`` in the user's code.
        A rank whose node did not yet have the payload never gets its Start: it is at
        rest, and says so (as a rank that returned nothing)."""
        assert self._server is not None
        with self._lock:
            if self._delivery is not None:
                self._delivery.cancelled = True
            waiting = {rank for rank in ranks if rank not in self._started}
        for rank in ranks - waiting:
            self._server.send(rank, Interrupt())
        for rank in sorted(waiting):
            self.events.put(Result(rank))

    def _took(self, message: Any) -> bool:
        if isinstance(message, Assigned) and self._start is None:
            self.names = message.names  # said to a kernel that attaches, before any run
        if isinstance(message, PayloadKept):
            self._payload_kept(message)
            return True
        if isinstance(message, Result) and message.file:
            self._received.append(Path(message.file))  # (removed if nobody reads it)
        return super()._took(message)

    def stop(self, clean: bool = False) -> None:
        """Cancel the job and wait until it has left the queue (or, ``clean``, let it end
        by itself first: the ranks at rest exit when the channel closes). Nothing, once
        detached."""
        if not self._detached:
            super().stop(clean)

    def close(self) -> None:
        if not self._detached:  # (the key stays for the kernel that attaches)
            super().close()
        self._forget_received()
        self._delivery = None

    def _forget(self) -> None:
        with _OPEN_LOCK:
            _OPEN.discard(self)


DATA_ROUTE_ENV = "NBDDP_SESSION_DATA"
"""How a cluster session's payloads reach the nodes: ``filesystem`` (the default: written
once to the session's folder, copied by each node) or ``channel`` (sent to each node)."""


class PayloadDelivery:
    """One run's payload, on its way to each node's local rank 0, which keeps a copy on
    its node (in shared memory where it fits) for the node's ranks to map: it crosses
    once per node. It goes one of two ways:

    - through the session's folder on the shared filesystem (the default): the kernel
      writes it there once, whatever the number of nodes, and each node copies it;
    - over the channel (``NBDDP_SESSION_DATA=channel``, or where the folder has no room
      for it): the kernel sends it to each node, hashed once (``_wire.transfer``).

    A node with no room for a copy maps the one in the session's folder."""

    def __init__(self, payload: Packed, run_dir: RunDir) -> None:
        self.payload: Packed | None = payload
        """The user's payload, until every node has it."""
        self.run_dir = run_dir
        self.shared: Path | None = None
        """The copy in the session's folder, once written."""
        run_dir.payload.unlink(missing_ok=True)  # (an earlier run's)
        if os.environ.get(DATA_ROUTE_ENV, "filesystem") != "channel":
            with contextlib.suppress(OSError):  # (no room: over the channel, then)
                self.write_shared()
        self.outgoing: Outgoing | None = Outgoing(payload) if self.shared is None else None
        self.copies: dict[str, str] = {}
        """Where each node keeps it, once it does."""
        self.cancelled = False
        """The run ended before every node had it: no more Starts go out."""
        self._sent_to: set[int] = set()

    def send_to(self, server: ChannelServer, rank: int) -> None:
        """Have ``rank`` (a node's local rank 0) keep it, once, in the background."""
        if rank in self._sent_to:
            return
        self._sent_to.add(rank)
        if self.shared is not None:
            server.send(rank, KeepPayload(copy_from=str(self.shared)))
        else:
            threading.Thread(target=server.send, args=(rank, KeepPayload(), self.outgoing),
                             daemon=True, name="nbddp-payload").start()

    def write_shared(self) -> Path:
        """The payload in the session's folder."""
        assert self.payload is not None  # (a node short of room comes before release)
        path = self.run_dir.payload
        dataplane.write(path, self.payload)
        self.shared = path
        return path

    def release(self) -> None:
        """Every node has it: let go of the user's tensors."""
        self.payload = self.outgoing = None


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
