"""Rank groups: the ranks of a run, their private run dir, the channel, their launcher.

A group can exist before any payload. A local group starts torchrun at once; its ranks
connect, import torch, join their gloo group if the run will use one, and wait for their
``Start`` (this is what standby ranks are). ``hand_over`` gives a group its run: the
payload, the records folder, the rank options and what changed in the notebook since
the ranks started. A session's group (``reusable``) is handed one run after another.
Any of a waiting group's processes may have died while idle: before the Start, the
ranks that wait for it answer a roll call, and a group that lost one is not handed the
run (``RanksGone``: the caller stops it and starts fresh ranks).
A SLURM group has no standby: handing it over submits the batch job.

The run (``Job``) reads a group's ``events``, and ends it with ``stop`` (every process)
and ``close`` (channel, run dir). Whatever started the ranks, torchrun here or a batch
job there, is a ``Launcher`` that the group waits on and stops: one protocol, no
branches in the run.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from . import _dataplane as dataplane
from . import _version
from ._channel import ChannelServer, new_key, tcp_address
from ._config import RunConfig
from ._dataplane import PAYLOAD_ROOM, RESULT_ROOM, Packed, Room
from ._errors import NbddpError
from ._mailbox import MailboxReader
from ._messages import (
    Disconnected,
    Failure,
    Hello,
    Present,
    RankOptions,
    Ready,
    RollCall,
    Sequenced,
    Start,
    encode,
)
from ._process import LocalLauncher, stopping
from ._records import Records
from ._rundir import RunDir
from ._shape import GroupShape, Handover
from ._slurm import SlurmLauncher, job_status, kernel_host, read_shape, submit
from ._slurm_options import SlurmOptions
from ._stacks import STACKS_SIGNAL, STACKS_WAIT, main_thread_id, read_dump, render, size_of

logger = logging.getLogger(__name__)


class Launcher(Protocol):
    """What started a group's ranks, as the group sees it."""

    def add_rank(self, pid: int) -> None:
        """A rank said hello with its PID (a local launcher stops it by that PID)."""

    def wait(self) -> int:
        """Block until the launcher has ended; its exit code."""

    def stop(self, clean: bool = False) -> None:
        """Stop every process; ``clean`` (every rank returned): let it end by itself first."""

    def stopped_from_outside(self) -> str | None:
        """Why the ranks were stopped by someone else (e.g. SLURM's time limit), if so."""


@dataclass(frozen=True)
class LauncherExited:
    """Kernel-side event: the group's launcher ended with ``code``."""

    code: int


class RankGroup:
    """What every group has: ``nprocs`` ranks, a private run dir, their messages."""

    where = ""
    """Where the ranks run when not on this machine, for the panel."""
    notice: str | None = None
    """A line for the notebook when the run starts on this group."""
    slurm_job_id: str | None = None
    requeues_seen = 0
    """The latest of SLURM's requeues of the job that the ranks' messages came from."""
    ends_after_result = False
    """After every rank returned, the run's value may be given before the launcher has
    ended: true where the kernel owns the processes (and sees them off regardless)."""
    reusable = False
    """A session's group: its ranks go back to rest after each run, for the next."""

    def __init__(self, nprocs: int, run_dir: RunDir) -> None:
        self.nprocs, self.run_dir = nprocs, run_dir
        self.events: queue.Queue[Any] = queue.Queue()
        self.launcher: Launcher | None = None
        self.records: Records | None = None
        self._server: ChannelServer | None = None
        self._closed = False
        self._closing = threading.Lock()

    def _follow_launcher(self, launcher: Launcher) -> None:
        self.launcher = launcher
        threading.Thread(target=self._wait_launcher, args=(launcher,), daemon=True,
                         name="nbddp-launcher").start()

    def _wait_launcher(self, launcher: Launcher) -> None:
        self.events.put(LauncherExited(launcher.wait()))

    def _start_message(self, payload: Path, records: Records, options: RankOptions,
                       handover: Handover) -> Start:
        twin = self.run_dir.twin
        return Start(_version.__version__, str(records.path), str(payload), options,
                     handover.cwd, dict(handover.env), session=self.reusable,
                     data=str(twin) if twin is not None else None)

    def new_records(self) -> Records:
        """The records folder for the run this group is about to be given."""
        return Records.create()

    def interrupt(self, ranks: set[int]) -> None:
        """Interrupt the user's code on ``ranks`` (a session's; others are stopped)."""

    def stacks(self, wait: float = STACKS_WAIT) -> dict[int, str]:
        """Every live rank's Python stacks; empty where the kernel cannot ask (a SLURM
        job's ranks run on other machines)."""
        return {}

    def hand_over(self, payload: Packed, records: Records, options: RankOptions,
                  handover: Handover) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        """Read now whatever the ranks sent through slower links (mailbox files)."""

    def requeues(self) -> int:
        """How many times SLURM has requeued the job by now (0 where no SLURM job runs)."""
        return 0

    def send_to_rank(self, rank: int, message: Any) -> bool:
        """Tell one rank something (pdb's input); False if it cannot be reached."""
        return self._server is not None and self._server.send(rank, message)

    def stopped_from_outside(self) -> str | None:
        return self.launcher.stopped_from_outside() if self.launcher else None

    def stop(self, clean: bool = False) -> None:
        """Stop every process of the group (and wait until they are gone)."""
        if self.launcher is not None:
            self.launcher.stop(clean)

    def retire(self) -> None:
        """Every rank returned: see the processes off (they are ending by themselves),
        and close the channel and the run dir."""
        self.stop(clean=True)
        self.close()

    def close(self) -> None:
        """After ``stop``: close the channel, keep torchrun's log with the run's records,
        remove the run dir. A second caller waits until the first is done."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            if self._server is not None:
                self._server.close()
            if self.records is not None and \
                    self.records.launcher_log != self.run_dir.launcher_log:
                with contextlib.suppress(OSError):
                    shutil.copyfile(self.run_dir.launcher_log, self.records.launcher_log)
            self.run_dir.remove()


ROLL_CALL_WAIT = 3.0
"""How long a waiting rank may take to answer its roll call. An idle rank answers within
a millisecond; one that has not answered by then is taken for stuck, and its group for
unfit to run."""


class RanksGone(NbddpError):
    """A waiting group cannot take its run: one of its processes stopped while it waited
    (a rank, or torchrun), or a rank did not answer its roll call. No rank was sent the
    Start; the group is to be stopped, and fresh ranks started."""

    def __init__(self, why: str) -> None:
        super().__init__(f"the waiting ranks cannot take the run: {why}")
        self.why = why
        """What happened, e.g. ``"rank 1 had stopped"``."""


_LOCAL_GROUPS: set[LocalGroup] = set()
_LOCAL_GROUPS_LOCK = threading.Lock()


@atexit.register
def _end_local_groups() -> None:
    """At the kernel's exit, no group outlives it: not one still being seen off after
    its run, not a standby one (their run dirs would stay on disk)."""
    with _LOCAL_GROUPS_LOCK:
        groups = list(_LOCAL_GROUPS)
    for group in groups:
        group.stop()
        group.close()


class LocalGroup(RankGroup):
    """torchrun on this machine, started now for ``shape``; its ranks wait for Start."""

    ends_after_result = True  # its lifeline and PIDs stop it, even if the kernel dies

    def __init__(self, shape: GroupShape) -> None:
        super().__init__(shape.nprocs, RunDir.create())
        with _LOCAL_GROUPS_LOCK:
            _LOCAL_GROUPS.add(self)
        self.shape = shape
        self._pids: dict[int, int] = {}  # rank -> PID, for those that said hello
        self.ready: set[int] = set()
        self.broken = False
        """A rank or torchrun ended before the group was handed a run."""
        self.on_change: Callable[[LocalGroup], None] | None = None
        self._start: Start | None = None
        self._lock = threading.Lock()
        self._settled = threading.Event()  # every rank is ready, or the group broke
        self._gone: str | None = None
        """Why the group can no longer run anything: a rank or torchrun stopped."""
        self._calls = 0  # roll calls so far: the number of the latest
        self._present: set[int] = set()  # who answered the latest
        self._answered = threading.Condition(self._lock)
        self._payload_file: Path | None = None
        self._rooms: dict[str, Room] = {}
        self._rooms_closed = False
        self._stopped = False
        try:
            key = new_key()
            self.run_dir.write_private(self.run_dir.key, key)
            self._server = ChannelServer(self.run_dir.socket, key, self._deliver)
            self._torchrun = LocalLauncher(self.run_dir, shape)
            self._follow_launcher(self._torchrun)
        except BaseException:
            self.stop()
            self.close()
            raise

    @property
    def is_ready(self) -> bool:
        """Every rank waits for its Start."""
        return len(self.ready) == self.nprocs and not self.broken

    @property
    def handed_over(self) -> bool:
        return self._start is not None

    def wait_ready(self, timeout: float) -> bool:
        """Block until every rank waits for its Start; False if the group broke first
        or ``timeout`` passed."""
        self._settled.wait(timeout)
        return self.is_ready

    def launcher_tail(self, lines: int = 30) -> str:
        """The end of torchrun's output (why a group broke)."""
        try:
            text = self.run_dir.launcher_log.read_text(errors="replace")
        except OSError:
            return "(nothing)"
        return "\n".join(text.splitlines()[-lines:])

    def pids(self) -> list[int]:
        """torchrun's and the live ranks' process ids."""
        return self._torchrun.pids()

    def rank_pids(self) -> dict[int, int]:
        """Each rank's process id (once it has said hello)."""
        with self._lock:
            return dict(self._pids)

    def _deliver(self, message: Any) -> None:
        """Keep track of the ranks (the channel's threads call this), then queue it."""
        inner = message.message if isinstance(message, Sequenced) else message
        with self._lock:
            if isinstance(inner, Present):  # the hand-over's business, not the run's
                if inner.call == self._calls:
                    self._present.add(inner.rank)
                    self._answered.notify_all()
                return
            if isinstance(inner, Disconnected):
                self._lose(f"rank {inner.rank} had stopped")
            if isinstance(inner, Hello):
                self._torchrun.add_rank(inner.pid)
                self._pids[inner.rank] = inner.pid
                if self._start is not None and self._server is not None:
                    self._server.send(inner.rank, self._start)
            elif isinstance(inner, Ready):
                self.ready.add(inner.rank)
            elif isinstance(inner, (Failure, Disconnected)) and self._start is None:
                self.broken = True
        self.events.put(message)
        self._changed()

    def _wait_launcher(self, launcher: Launcher) -> None:
        code = launcher.wait()
        with self._lock:
            self.broken = self.broken or self._start is None
            self._lose("torchrun had stopped")
        self.events.put(LauncherExited(code))
        self._changed()

    def _lose(self, why: str) -> None:
        """(Under the lock) The group lost a process: it can take no run from now on."""
        self._gone = self._gone or why
        self._answered.notify_all()

    def _changed(self) -> None:
        if self.is_ready or self.broken:
            self._settled.set()
        notify = self.on_change
        if notify is not None:
            notify(self)

    def hand_over(self, payload: Packed, records: Records, options: RankOptions,
                  handover: Handover) -> None:
        """Call the roll of the ranks that wait for their Start, write the payload (into
        shared memory if it fits) while they answer, then send every rank its Start (a
        rank that has not said hello yet gets it when it does). Raises ``RanksGone``, and
        sends no Start, if the waiting ranks are not all there. A session's group is
        handed one run after another: each replaces the last one's payload."""
        called = self._roll_call()
        if self._payload_file is not None:
            self._payload_file.unlink(missing_ok=True)
        size = dataplane.size_of(payload)
        room = self._take_room(size)
        folder = dataplane.place(size, self.run_dir.path, self.run_dir.twin) \
            if room is None else room.parent
        self._payload_file = folder / self.run_dir.payload.name
        dataplane.write(self._payload_file, payload, room)
        start = self._start_message(self._payload_file, records, options, handover)
        with self._lock:
            self._await_answers(called)
            self.records = records
            self._start = start
            assert self._server is not None
            for rank in self._pids:
                self._server.send(rank, start)

    def _roll_call(self) -> set[int]:
        """Ask the ranks that wait for their Start to answer (at once, from the rank's
        listening thread); those ranks. A rank still starting is not asked: like a cold
        launch's ranks, it gets its Start when it is up. Raises ``RanksGone`` if a
        process of a group already up has stopped (a cold group's early end is the
        run's to tell, with torchrun's output)."""
        with self._lock:
            called = {rank for rank in self.ready if rank in self._pids}
            self._calls += 1
            self._present = set()
            assert self._server is not None
            for rank in sorted(called):
                if not self._server.send(rank, RollCall(self._calls)):
                    self._lose(f"rank {rank} had stopped")
            if self._pids and self._gone is not None:
                raise RanksGone(self._gone)
        return called

    def _await_answers(self, called: set[int]) -> None:
        """(Under the lock) Wait until every rank ``called`` has answered; RanksGone if
        the group lost a process, or a rank stays silent for ``ROLL_CALL_WAIT`` s."""
        if not called:
            return
        every = self._answered.wait_for(
            lambda: self._gone is not None or called <= self._present, ROLL_CALL_WAIT)
        if self._gone is not None:
            raise RanksGone(self._gone)
        if not every:
            silent = ", ".join(str(rank) for rank in sorted(called - self._present))
            raise RanksGone(f"rank {silent} did not answer within {ROLL_CALL_WAIT:g} s")
        if stopping(self._torchrun.process.pid):  # killed: the ranks die of it next
            raise RanksGone("torchrun had stopped")
        for rank in sorted(called):
            if stopping(self._pids[rank]):  # killed since it answered
                raise RanksGone(f"rank {rank} had stopped")

    def make_room(self, payload: int, result: int = 0) -> None:
        """Allocate shared memory in the background for the next payload and result
        (about the last ones' sizes), so that each is one copy into ready pages."""
        self._discard_rooms()
        twin = self.run_dir.twin
        if twin is None:
            return
        with self._lock:  # a group being closed makes none: nothing would remove them
            if not self._rooms_closed:
                self._rooms = {name: Room(twin / name, nbytes) for name, nbytes in
                               ((PAYLOAD_ROOM, payload), (RESULT_ROOM, result))
                               if nbytes >= Room.MIN}

    def _discard_rooms(self) -> None:
        with self._lock:
            rooms, self._rooms = self._rooms, {}
        for room in rooms.values():
            room.discard()

    def _take_room(self, size: int) -> Path | None:
        """The payload's room allocated ahead, if the payload (``size`` bytes) can go
        there."""
        with self._lock:
            room = self._rooms.pop(PAYLOAD_ROOM, None)
        if room is None or self.run_dir.twin is None or (path := room.take()) is None:
            return None
        have = path.stat().st_size
        if size > have and not dataplane.fits(size - have, self.run_dir.twin):
            path.unlink(missing_ok=True)
            return None
        return path

    def stacks(self, wait: float = STACKS_WAIT) -> dict[int, str]:
        """Every live rank's Python stacks (all threads, the main one first), taken
        without stopping it; a rank that does not answer within ``wait`` s is left out."""
        pids = self.rank_pids()
        files = {rank: self.run_dir.stacks_file(rank) for rank in pids}
        sizes = {rank: size_of(path) for rank, path in files.items()}
        answering = self._torchrun.signal_ranks(pids.values(), STACKS_SIGNAL)
        stacks = {}
        for rank, path in sorted(files.items()):
            dump = read_dump(path, sizes[rank], wait) if pids[rank] in answering else None
            if dump is not None:
                stacks[rank] = render(dump, main_thread_id(path))
        return stacks

    def interrupt(self, ranks: set[int]) -> None:
        self._torchrun.interrupt([self._pids[r] for r in ranks if r in self._pids])

    def stop(self, clean: bool = False) -> None:
        self.on_change = None
        super().stop(clean)
        self._stopped = True
        self._forget_when_done()

    def retire(self) -> None:
        """Close first: nothing needs the channel or the run dir once every rank has
        returned, and a kernel killed while torchrun exits must leave neither behind."""
        self.close()
        self.stop(clean=True)

    def close(self) -> None:
        with self._lock:
            self._rooms_closed = True
        self._discard_rooms()
        super().close()
        self._forget_when_done()

    def _forget_when_done(self) -> None:
        """Stopped and closed: nothing is left for the exit hook to end."""
        if self._stopped and self._closed:
            with _LOCAL_GROUPS_LOCK:
                _LOCAL_GROUPS.discard(self)


class SlurmGroup(RankGroup):
    """A batch job's ranks: they report over TCP when they can reach the kernel, and
    always through mailbox files in the run folder (which is also its records)."""

    def __init__(self, config: RunConfig, run_dir: RunDir) -> None:
        super().__init__(config.nprocs, run_dir)
        self.config = config
        self.options: SlurmOptions | None = None
        self.records = Records(run_dir.path)
        self._mailbox = MailboxReader(run_dir.path, config.nprocs, self._deliver)

    @classmethod
    def for_submission(cls, config: RunConfig, options: SlurmOptions) -> SlurmGroup:
        """A run folder on the shared filesystem and a TCP channel, ready for ``hand_over``."""
        group = cls(config, RunDir.create_shared())
        group.options = options
        try:
            group._listen()
        except BaseException:
            group.stop()
            group.close()
            raise
        return group

    def _listen(self) -> None:
        """The TCP channel, on the one address the ranks are told to use; none where
        this machine's name for itself does not resolve (the ranks then report through
        their mailbox files alone, as they do when they cannot reach the kernel)."""
        key = new_key()
        self.run_dir.write_private(self.run_dir.key, key)
        try:
            host = tcp_address(kernel_host())
        except ConnectionError as exc:
            logger.info("nbddp: no TCP channel for the ranks: %s", exc)
            return
        self._server = ChannelServer((host, 0), key, self._deliver)
        self.run_dir.write_private(self.run_dir.address,
                                   f"{host} {self._server.port}".encode())

    @classmethod
    def attached(cls, run_dir: RunDir) -> SlurmGroup:
        """The group of a job submitted earlier (e.g. before a kernel restart)."""
        shape = read_shape(run_dir)
        config = RunConfig(nprocs=shape["nprocs"], all_ranks=shape["all_ranks"],
                           output=shape["output"])
        Records(run_dir.path).metrics.unlink(missing_ok=True)  # rebuilt from the mailboxes
        group = cls(config, run_dir)
        group.sync()  # everything written so far: which requeue of the job the ranks are on
        group._follow(shape["job_id"], f"nbddp: attached to SLURM job {shape['job_id']}")
        return group

    def _deliver(self, message: Any) -> None:
        if not isinstance(message, Disconnected):  # the rank's mailbox still speaks for it
            self.requeues_seen = max(self.requeues_seen, getattr(message, "requeue", 0))
            self.events.put(message)

    def requeues(self) -> int:
        """SLURM's count, asked now (a rank's failure may be the requeue's doing), or what
        the ranks' messages show if SLURM no longer knows the job."""
        assert self.slurm_job_id is not None
        try:
            restarts = job_status(self.slurm_job_id).restarts
        except NbddpError:
            restarts = 0
        return max(restarts, self.requeues_seen)

    def _follow(self, job_id: str, notice: str) -> None:
        self.slurm_job_id, self.where, self.notice = job_id, f"SLURM job {job_id}", notice
        self._follow_launcher(SlurmLauncher(job_id, self.events.put))

    def new_records(self) -> Records:
        assert self.records is not None
        return self.records

    def hand_over(self, payload: Packed, records: Records, options: RankOptions,
                  handover: Handover) -> None:
        """Write the payload and the ranks' Start into the run folder, and submit."""
        dataplane.write(self.run_dir.payload, payload)
        self.run_dir.write_private(self.run_dir.start, encode(
            self._start_message(self.run_dir.payload, records, options, handover)))
        assert self.options is not None
        job_id = submit(self.run_dir, self.config, self.options)
        self._follow(job_id, f"nbddp: submitted SLURM job {job_id}; after a kernel restart, "
                             f"nbddp.attach({job_id!r}) follows it again")

    def sync(self) -> None:
        self._mailbox.poll()

    def stop(self, clean: bool = False) -> None:
        super().stop(clean)
        self._mailbox.close()  # after a last read of what the ranks wrote
