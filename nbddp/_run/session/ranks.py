"""A session's ranks over its life: the group that holds them now, and each run handed
to them.

The group is replaced by fresh ranks when the session restarts, when a rank died while
they were idle (found as the next run is handed over), and when a run ends without
every rank back at rest; each time, what the ranks held (their names, the modules
they were taught) is gone, and the next run carries it again. ``Session``
(the front door) keeps the lock, the run in flight and the user's settings; this keeps
the ranks, their records, and the names held on them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import time
from typing import TextIO, TypeVar

from ..._errors import NbddpError
from ..._wire.dataplane import Packed
from ..._wire.payload import Payload
from ..._wire.shipped_code import CodeSent
from ..._wire.shipped_code import wanted as code_wanted
from ..backend import Backend
from ..config import RunConfig
from ..groups.group import RanksGone
from ..groups.shape import GroupShape
from ..groups.waiting import WaitingGroup
from ..interrupt_hold import InterruptHold
from ..job import Job, data_bytes, note_under
from ..records import FolderPerCell, Records, SessionRecords
from .names import SessionNames
from .on_session import STATE_LOST, OnSession
from .snapshots import SessionSnapshots, parse_size
from .status import SessionStatus, rss_mib

G = TypeVar("G", bound=WaitingGroup)
T = TypeVar("T")
SNAPSHOT_WAIT = 2.0
"""Seconds ``%ddp_session`` waits for the last cell's snapshot, if it is being written
(then it names that cell, the one a rank lost now would restore)."""


class SessionRanks:
    """The ranks of one session on ``where``, held by ``group`` now (started, or found
    again by a kernel that attached: ``names`` are those they hold)."""

    def __init__(self, where: Backend, group: WaitingGroup,
                 names: frozenset[str] = frozenset()) -> None:
        self.where = where
        self.group = as_sessions(group)
        self.records: SessionRecords | FolderPerCell = where.session_records()
        self.held = SessionNames(names)
        self.snapshots = SessionSnapshots(where.config.nprocs)
        """Snapshots of the ranks' names, restored by fresh ranks (off until asked)."""
        self.runs = 0
        self.restarts = 0
        self.started = time.monotonic()
        """When the ranks now holding the session started."""
        self.closed = False
        self.busy = False
        """A run goes on (set before its Job exists, cleared at its end)."""
        self.running: Job | None = None
        """The run going on (forgotten at its end: the session holds no run's result,
        which may be gigabytes the notebook has let go of)."""
        self._hosts: dict[int, str] = {}
        """Each rank's machine, as the last run said (what status shows)."""

    @classmethod
    def start_on(cls, where: Backend) -> SessionRanks:
        """A new session's ranks, started on ``where`` (standby ranks may be taken)."""
        return cls(where, where.session_group(standby=True))

    def _start(self, standby: bool = True) -> None:
        """Fresh ranks for the group (``standby``: waiting standby ranks may be taken)."""
        self.group = as_sessions(self.where.session_group(standby))
        self.started = time.monotonic()

    def wait_ready(self, hold: InterruptHold | None = None) -> None:
        """Block until every rank waits for its first run (``hold``: Ctrl-C held while
        they started, let go now); the backend's error if they do not come."""
        if hold is not None:
            hold.release()
        if not self.where.wait_placed(self.group):
            raise self.where.not_ready(self.group)

    def replace(self, standby: bool = True) -> None:
        """(Under the session's lock) Stop the ranks and start fresh ones: what the
        session defined is gone (its snapshots too)."""
        self._renew(standby)
        self.snapshots.forget()

    def _renew(self, standby: bool = True) -> None:
        """Stop the ranks and start fresh ones (which may restore a snapshot)."""
        self.stop()
        self.held.lost()
        self.restarts += 1
        self._start(standby)
        self.records.new_ranks()

    def keep_snapshots(self, setting: bool | int | str) -> None:
        """Turn snapshots on (from the next cell; a size: capped at it) or off (every
        snapshot goes). ValueError for a size that is none."""
        if setting is False:
            self.snapshots.turn_off()
            return
        if self.closed:
            raise NbddpError("this session is closed; start another one")
        cap = None if setting is True else parse_size(setting)
        check_snapshots(self.where)
        self.snapshots.turn_on(cap)

    def stop(self) -> None:
        self.group.stop()
        self.group.close()

    def close(self) -> None:
        """Stop the ranks for good: their snapshots go too."""
        try:
            self.stop()
        finally:
            self.snapshots.turn_off()

    # --- a run ------------------------------------------------------------------------

    def packed(self, payload: Payload, config: RunConfig) -> Packed:
        """``payload`` pickled for the ranks, with the user's module files they lack
        where their nodes may not see the notebook's."""
        code = self.group.code if self.where.ships_code and code_wanted() else None
        return payload.dumps(self.where.kernels_copies(), code,
                             look_at_files=config.autoreload)

    def hand_over(self, config: RunConfig, payload: Payload,
                  packed: Packed) -> tuple[Records, bool, Packed]:
        """(Under the session's lock) Give the ranks the run; if one of their processes
        died while they were idle, give it to fresh ranks, and say so. The run's records,
        whether the session's ranks (not fresh ones) took it, and the payload as they
        took it."""
        records = self.records.next_cell(self.runs + 1)
        try:
            return records, True, self._hand_to(config, payload, packed, records)
        except RanksGone as gone:
            self._renew(standby=False)
            records = self.records.redo(records, self.runs + 1)
            lost = self.snapshots.when_lost(cell_lost=False) or (
                STATE_LOST if self.runs else "this first run starts on fresh ranks")
            self.group.notice = f"nbddp: session: {gone.why} while idle; {lost}"
        return records, False, self._hand_to(config, payload, packed, records)

    def check_idle(self) -> None:
        """NbddpError unless the ranks can take a run now."""
        if self.closed:
            raise NbddpError("this session is closed; start another one")
        if self.busy:
            raise NbddpError("the session's ranks are still running the last run; wait "
                             "for it (job.result()) or cancel it first")

    def handed(self, config: RunConfig, payload: Payload, packed: Packed,
               stdout: TextIO | None, caller_waits: bool, auto: bool) -> Job:
        """(Under the session's lock) The run handed to the ranks (``hand_over``), if they
        are idle, and followed by its ``Job``, which ends it here (``ended``). The Job's
        other settings are ``Job``'s; ``auto``: the session is in auto mode."""
        self.check_idle()
        self.busy = True
        try:
            records, warm, packed = self.hand_over(config, payload, packed)
            run = OnSession(self.group, lambda: self.snapshots.when_lost(cell_lost=True),
                            restoring=self.snapshots.restoring is not None)
            code = packed.code if config.ranks is None else None  # (taught to every rank)
            job: Job = Job(self.group, config, records, stdout=stdout, warm=warm,
                           sent=packed.buffer_bytes, staying=run,
                           after=lambda job: self._over(job, run, code),
                           where=_labelled(self.group.where, self.runs + 1, auto,
                                           config.autoreload), caller_waits=caller_waits,
                           quiet_when_quick=not auto)
        except BaseException:
            self.busy = False
            raise
        self.group.notice = None  # said once, under this run
        self.running = job
        return job

    def _over(self, job: Job, run: OnSession, code: CodeSent | None) -> None:
        """A run ended: its ranks kept or replaced, the session free for the next."""
        try:
            self.closed = self.ended(job, run, code, self.closed)
        finally:
            self._hosts = self.where.hosts(self.group, job)
            self.running = None
            self.busy = False

    def _hand_to(self, config: RunConfig, payload: Payload, packed: Packed,
                 records: Records) -> Packed:
        """Give the ranks the run; the payload they took (pickled again if it counted on
        module files other ranks held: the ranks were replaced since)."""
        group = self.group
        if packed.code is not None and packed.code.ranks is not group.code:
            packed = self.packed(payload, config)
        handover, left_out = group.shape.take_up(GroupShape.of(config))
        self.held.warn_left_out(left_out)
        options = config.rank_options
        if self.snapshots.on:
            self._take_snapshot_notes()  # (the last cell's, too)
            options = dataclasses.replace(options, snapshot=self.snapshots.order(self.runs + 1),
                                          restore=self.snapshots.restoring)
        group.hand_over(packed, records, options, handover)
        return packed

    def ended(self, job: Job, run: OnSession, code: CodeSent | None, closed: bool) -> bool:
        """A run ended: keep the ranks' names, or (unless the session is ``closed``)
        start fresh ranks if they were lost; the module files its payload taught, once
        every rank returned, are held. The next run's rooms are made as large as this one's
        data (the next cell likely sends and gets as much again). Whether the session is
        closed now (the kernel left the job for another: nothing to restart)."""
        self.runs += 1
        closed = closed or self.where.left(self.group)
        self._take_snapshot_notes()
        if run.kept:
            self.group.payload_taken()
            if run.returned and code is not None:
                code.confirm()
            self.held.kept(run, some_ranks=job.config.ranks is not None)
            self.snapshots.ended(self.runs, run.returned, self.held.bound)
        else:
            self.held.lost()
            if run.restore_failed:
                self.snapshots.forget()  # (what could not be restored, is not again)
            if not closed:
                self.restarts += 1
                self.records.new_ranks()
                self._start()
                restores = self.snapshots.when_lost(cell_lost=True) is not None
                note_under(job, "session: restarted with fresh ranks; " + (
                    "they restore the last snapshot first" if restores
                    else "what earlier runs defined is gone"))
        if not closed:
            self.group.make_room(*data_bytes(job))
        return closed


    def status(self, is_open: bool, auto: bool, reloads: bool) -> SessionStatus:
        """The ranks, their PIDs and memory, and the session's age (``is_open``: not
        closed)."""
        group, config = self.group, self.where.config
        pids = group.rank_pids() if is_open else {}
        backend = config.backend or ("gloo" if group.shape.prepare else "nccl")
        place = self.where.place(group)
        self._take_snapshot_notes(0 if self.busy else SNAPSHOT_WAIT)
        return SessionStatus(is_open, config.nprocs,
                             backend if config.init else "no process group",
                             time.monotonic() - self.started, self.runs, self.restarts,
                             pids, {rank: rss for rank, pid in pids.items()
                                    if not place and (rss := rss_mib(pid)) is not None},
                             place, self._where_ranks_run(), auto, reloads,
                             self.snapshots.status())

    def _where_ranks_run(self) -> dict[int, str]:
        """Each rank's machine, as the ranks' group or the run going on says, else as the
        last run said."""
        return {**self._hosts, **self.where.hosts(self.group, self.running)}

    def _take_snapshot_notes(self, wait: float = 0.0) -> None:
        """Take in what the ranks said of their snapshots (with ``wait``: up to that long
        until the last kept cell's is written on every rank)."""
        said, deadline = self.group.snapshots_taken, time.monotonic() + wait
        self.snapshots.noted(_drained(said))
        while self.snapshots.writing and (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(queue.Empty):
                self.snapshots.noted([said.get(timeout=left), *_drained(said)])


def _drained(said: queue.SimpleQueue[T]) -> list[T]:
    """What ``said`` holds now, taken off it."""
    taken = []
    with contextlib.suppress(queue.Empty):
        while True:
            taken.append(said.get_nowait())
    return taken


def check_snapshots(where: Backend, setting: bool | int | str = True) -> None:
    """NbddpError if a session on ``where`` cannot keep snapshots; ValueError if
    ``setting`` is a size that is none."""
    if setting is not True:
        parse_size(setting)
    if not where.keeps_snapshots:
        raise NbddpError("session snapshots are kept for sessions on this machine only, "
                         "not yet on SLURM or Ray")


def as_sessions(group: G) -> G:
    """``group`` as a session's: its ranks stay for the next run, and the panel says so."""
    group.reusable = True
    group.where = f"session, {group.where}" if group.where else "session"
    return group


def _labelled(where: str, run: int, auto: bool, autoreload: bool) -> str:
    """Where the panel says the ``run``-th run of a session group at ``where`` runs:
    ``session`` (or ``session, SLURM job 12``), then ``run 3``, and auto mode and
    autoreload when on."""
    said = [f"run {run}"] + ["auto mode"] * auto + ["autoreload"] * autoreload
    return f"{where} · {', '.join(said)}"
