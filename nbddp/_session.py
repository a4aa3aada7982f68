"""Sessions: ranks that keep their state from one run to the next.

A session is one rank group whose ranks go back to rest after each run instead of
exiting. Each rank keeps one namespace for the notebook code it runs (see ``_rank.scope``),
and its process group. Runs are handed to the group one at a time; each is a ``Job``
with its own records, panel and history. A run that ends early (a rank raised, an
interrupt, a timeout) keeps the ranks if every one comes back to rest; otherwise, and
when a rank dies, the ranks are stopped, fresh ones start, and the error says that the
state is gone. An idle session waits as long as it is open; if one of its processes dies
meanwhile, the next run finds out before it starts (the ranks' roll call, see
``_run.waiting``), and runs on fresh ranks, saying that the state is gone.

Where the ranks run is the backend's (``_run.backend``, chosen in ``_backends``): on this
machine (started by torchrun here, or taken from standby), or on a cluster's nodes (one
SLURM job, one Ray placement group), which the session waits for, showing its state.
Every run is handed to the ranks the same way.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TextIO, TypeVar

from ._backends import Ray, Slurm, attached_session, chosen_cluster, session_backend
from ._errors import NbddpError
from ._notebook.ipython_autoreload import notebook_autoreloads
from ._run.backend import Backend
from ._run.config import (
    DEFAULT_STALL_AFTER,
    ClusterOptions,
    ConfigPerRun,
    RunConfig,
    RunOptions,
)
from ._run.group import RanksGone
from ._run.interrupt_hold import InterruptHold, held_while, interrupt_after
from ._run.job import Job
from ._run.rank_choice import chosen_ranks
from ._run.records import FolderPerCell, Records, SessionRecords
from ._run.session_names import SessionNames
from ._run.session_run import STATE_LOST, OnSession
from ._run.session_status import SessionStatus, rss_mib
from ._run.shape import GroupShape
from ._run.waiting import WaitingGroup
from ._wire.dataplane import Packed
from ._wire.held_functions import Teaching
from ._wire.payload import Payload
from ._wire.shipped_code import wanted as code_wanted

R = TypeVar("R")
G = TypeVar("G", bound=WaitingGroup)

class Session:
    """Ranks that keep their state between runs: variables, models, data loaders, the
    process group.

    ``Session(nprocs=2)`` starts the ranks (as ``launch`` would: ``gpus``, ``backend``,
    ``init``, ``env``). ``run(fn, *args, **kwargs)`` runs ``fn`` on every rank and
    returns rank 0's value, ``run_all`` every rank's. Globals that session code assigns
    (``global model; model = ...``, or a ``%%ddp`` cell's names) stay on the ranks for
    the next run. ``timeout`` bounds each run. A failing rank raises ``WorkerError``;
    the error says whether the ranks kept their state or were restarted. ``close()``
    (or leaving a ``with`` block) stops them; so does the kernel's end.

    ``cluster=nbddp.Slurm(nodes=2, ...)`` starts them as one SLURM job instead,
    ``nprocs`` (or ``gpus``) ranks per node, and waits until the job runs (its state is
    shown meanwhile; Ctrl-C cancels it). Its ranks outlive the kernel for ``grace``
    seconds (None, the default: as long as the job runs; 0: they end with the kernel),
    and ``Session.attach(job_id)`` in a new kernel reconnects to them, state and all.
    ``close()`` cancels the job.

    ``cluster=nbddp.Ray(nodes=2, ...)`` starts them on a Ray cluster's nodes, ``nprocs``
    per node, as one placement group; with ``grace`` (or ``Ray(grace=...)``) they outlive
    the kernel that long, and ``Session.attach()`` reconnects a new kernel. (``slurm=``
    and ``ray=`` are the older spelling of ``cluster=``: they still work, with a warning.)
    """

    def __init__(self, nprocs: int | None = None, *, gpus: int | Sequence[int] | None = None,
                 backend: str | None = None, init: bool = True, timeout: float | None = None,
                 env: Mapping[str, str] | None = None,
                 output: Literal["rank0", "all", "none"] = "rank0",
                 cluster: ClusterOptions | None = None, grace: float | None = None,
                 slurm: bool | Slurm = False, ray: bool | Ray = False) -> None:
        options = RunOptions(nprocs=nprocs, gpus=gpus, backend=backend, init=init,
                             timeout=timeout, env=env, output=output)
        chosen = chosen_cluster(cluster, slurm, ray)
        self._begin(session_backend(options, chosen, grace))
        self._group, hold = held_while(self._new_group)  # a press: stops them once they exist
        self._wait_ready(hold)
        self._where.started(self._group)

    @classmethod
    def attach(cls, job_id: str | int | None = None) -> Session:
        """The session whose SLURM job ``job_id`` (or Ray session, ``ray-...``) holds the
        ranks, e.g. after a kernel restart: its ranks reconnect to this kernel, with their
        state. Without ``job_id``, this account's one running session (several are
        listed in the error). Only the user who started the session can attach: the key
        is theirs."""
        where, group, names = attached_session(job_id)
        session = cls.__new__(cls)
        session._begin(where)
        session._group = _as_sessions(group)
        session._held = SessionNames(names)
        return session

    def _begin(self, where: Backend) -> None:
        self.config = where.config
        self._where = where
        """The backend: where the ranks run, how they start, and how that is said."""
        self._lock = threading.Lock()
        self._busy = False  # a run goes on (set before its Job exists, cleared at its end)
        self._running: Job | None = None
        self._records: SessionRecords | FolderPerCell = where.session_records()
        self._closed = False
        self.runs = 0
        self.restarts = 0
        self._held = SessionNames()
        self.auto = False
        """Auto mode (``%ddp_session auto on``): every cell runs on the ranks; the panel
        says so."""
        self.autoreload: bool | None = None
        """Reload the user's edited modules on the ranks before each run: True, False, or
        None, as the notebook's own ``%autoreload 2`` does (see ``reloads``)."""
        self._started = time.monotonic()
        self._configs = ConfigPerRun()

    def _new_group(self, standby: bool = True) -> WaitingGroup:
        group = self._where.session_group(standby)
        self._started = time.monotonic()
        return _as_sessions(group)

    def _wait_ready(self, hold: InterruptHold | None = None) -> None:
        """Block until every rank waits for its first run (Ctrl-C stops them, one held
        by ``hold`` while they started too)."""
        group = self._group
        try:
            if hold is not None:
                hold.release()
            ready = self._where.wait_placed(group)
        except KeyboardInterrupt:
            self.close()
            raise
        if not ready:
            self.close()
            raise self._where.not_ready(group)

    # --- runs -----------------------------------------------------------------------

    def run(self, fn: Callable[..., R], /, *args: Any, ranks: Sequence[int] | None = None,
            **kwargs: Any) -> R:
        """``fn(*args, **kwargs)`` on every rank, in the session's namespace; rank 0's
        value. ``ranks=[0]`` runs it on those ranks only (the others stay at rest, with
        their state; the value is the lowest one's; a collective in ``fn`` would wait for
        the others forever). Interrupting the wait interrupts the ranks."""
        __tracebackhide__ = True
        return self.call(fn, args, kwargs, ranks=ranks)

    def run_all(self, fn: Callable[..., R], /, *args: Any, ranks: Sequence[int] | None = None,
                **kwargs: Any) -> list[R]:
        """Like ``run``, with every rank's value (each of ``ranks``'), in rank order."""
        __tracebackhide__ = True
        return self.call(fn, args, kwargs, all_ranks=True, ranks=ranks)

    def call(self, fn: Callable[..., Any], args: Sequence[Any] = (),
             kwargs: Mapping[str, Any] | None = None, *, all_ranks: bool = False,
             timeout: float | None = None,
             output: Literal["rank0", "all", "none"] | None = None,
             stall_after: float | None = DEFAULT_STALL_AFTER, pdb: bool = False,
             ranks: Sequence[int] | None = None) -> Any:
        """Run ``fn`` on the ranks and wait for its value, with every setting of
        ``submit``: what ``run``, ``run_all`` and a ``%%ddp`` cell on the session do.
        Interrupting the wait interrupts the ranks."""
        __tracebackhide__ = True
        config = self._config_for(all_ranks, timeout, output, stall_after, pdb, ranks)
        return self._submitted(fn, args, kwargs, config, caller_waits=True).result()

    def submit(self, fn: Callable[..., Any], args: Sequence[Any] = (),
               kwargs: Mapping[str, Any] | None = None, *, all_ranks: bool = False,
               timeout: float | None = None,
               output: Literal["rank0", "all", "none"] | None = None,
               stdout: TextIO | None = None,
               stall_after: float | None = DEFAULT_STALL_AFTER, pdb: bool = False,
               ranks: Sequence[int] | None = None) -> Job:
        """Hand one run to the ranks and return its ``Job`` at once.
        ``timeout`` and ``output`` default to the session's; ``pdb``: a rank that raises
        opens pdb in the notebook at the failing frame first (as ``launch``'s);
        ``ranks``: the ranks that run it (as ``run``'s)."""
        __tracebackhide__ = True
        config = self._config_for(all_ranks, timeout, output, stall_after, pdb, ranks)
        return self._submitted(fn, args, kwargs, config, stdout)._handed_back()

    def _config_for(self, all_ranks: bool = False, timeout: float | None = None,
                    output: Literal["rank0", "all", "none"] | None = None,
                    stall_after: float | None = DEFAULT_STALL_AFTER, pdb: bool = False,
                    ranks: Sequence[int] | None = None) -> RunConfig:
        """A run's config: the session's, with ``submit``'s settings."""
        return self._configs.for_run(self.config, all_ranks=all_ranks,
                                     output=output or self.config.output,
                                     timeout=timeout or self.config.timeout,
                                     stall_after=stall_after, pdb=pdb,
                                     ranks=chosen_ranks(ranks, self.config.nprocs),
                                     autoreload=self.reloads)

    def _submitted(self, fn: Callable[..., Any], args: Sequence[Any],
                   kwargs: Mapping[str, Any] | None, config: RunConfig,
                   stdout: TextIO | None = None, caller_waits: bool = False) -> Job:
        """Hand one run to the ranks, with Ctrl-C held back from the payload's pickling to
        the ranks' start; its ``Job``, not yet handed back. ``caller_waits``: the caller
        calls its ``result()`` next, and follows the run's start itself (see ``_run.job``)."""
        __tracebackhide__ = True
        return Job.started_held(functools.partial(self._start, fn, args, kwargs, config,
                                                  stdout, caller_waits))

    def _packed(self, payload: Payload, config: RunConfig, group: WaitingGroup) -> Packed:
        """``payload`` pickled for ``group``'s ranks: the notebook functions they hold
        by number, unless the run is on some ranks only (which alone would take it)."""
        functions = group.functions if config.ranks is None else None
        code = group.code if self._where.ships_code and code_wanted() else None
        return payload.dumps(self._where.kernels_copies(), functions, code,
                             look_at_files=config.autoreload)

    def _start(self, fn: Callable[..., Any], args: Sequence[Any],
               kwargs: Mapping[str, Any] | None, config: RunConfig, stdout: TextIO | None,
               caller_waits: bool) -> Job:
        """Pickle the run and hand it to the ranks, unless they are busy; its ``Job``."""
        payload = Payload.capture(fn, tuple(args), dict(kwargs or {}))
        packed = self._packed(payload, config, self._group)
        with self._lock:
            self._check_idle()
            self._busy = True
            try:
                records, warm, packed = self._hand_over(config, payload, packed)
                run = OnSession(self._group)
                teaching = Teaching(packed.functions, packed.teaches,
                                    packed.code if config.ranks is None else None)
                job: Job = Job(self._group, config, records, stdout=stdout, warm=warm,
                               sent=packed.buffer_bytes, staying=run,
                               after=lambda job: self._after_run(job, run, teaching),
                               where=_labelled(self._group.where, self.runs + 1, self.auto,
                                               config.autoreload), caller_waits=caller_waits,
                               quiet_when_quick=not self.auto)
                self._group.notice = None  # said once, under this run
            except BaseException:
                self._busy = False
                raise
            self._running = job
        try:
            self._records.prepare()
        except BaseException:
            job._followed_after_all()  # (nobody will wait for the run: it still ends)
            raise
        return job

    @property
    def reloads(self) -> bool:
        """Whether the next run reloads the ranks' edited modules first: ``autoreload``,
        or where that is None, whether the notebook's ``%autoreload`` checks every module
        (``%autoreload 2`` or 3)."""
        return self.autoreload if self.autoreload is not None else notebook_autoreloads()

    def _hand_over(self, config: RunConfig, payload: Payload,
                   packed: Packed) -> tuple[Records, bool, Packed]:
        """(Under the lock) Give the ranks the run; if one of their processes died while
        they were idle, give it to fresh ranks, and say so. The run's records, whether
        the session's ranks (not fresh ones) took it, and the payload as they took it."""
        records = self._records.next_cell(self.runs + 1)
        try:
            return records, True, self._hand_to(config, payload, packed, records)
        except RanksGone as gone:
            self._replace_group(standby=False)
            records = self._records.redo(records, self.runs + 1)
            lost = STATE_LOST if self.runs else "this first run starts on fresh ranks"
            self._group.notice = f"nbddp: session: {gone.why} while idle; {lost}"
        return records, False, self._hand_to(config, payload, packed, records)

    def _hand_to(self, config: RunConfig, payload: Payload, packed: Packed,
                 records: Records) -> Packed:
        """Give the session's ranks the run; the payload they took (pickled again if it
        named functions other ranks held: the ranks were replaced since)."""
        group = self._group
        if (packed.functions is not None and packed.functions is not group.functions) or (
                packed.code is not None and packed.code.ranks is not group.code):
            packed = self._packed(payload, config, group)
        handover, left_out = group.shape.take_up(GroupShape.of(config))
        self._held.warn_left_out(left_out)
        group.hand_over(packed, records, config.rank_options, handover)
        return packed

    def _check_idle(self) -> None:
        if self._closed:
            raise NbddpError("this session is closed; start another one")
        if self._busy:
            raise NbddpError("the session's ranks are still running the last run; wait "
                             "for it (job.result()) or cancel it first")

    def _after_run(self, job: Job, run: OnSession, teaching: Teaching) -> None:
        """A run ended: keep the ranks' names, or start fresh ranks if they were lost;
        the functions its payload taught, once every rank returned, are held. The next
        run's rooms are made as large as this one's data (the next cell likely sends and
        gets as much again)."""
        self.runs += 1
        if self._where.left(self._group):
            self._closed = True  # the kernel left the job for another: nothing to restart
        try:
            if run.kept:
                self._group.payload_taken()
                if run.returned:
                    teaching.confirm()
                self._held.kept(run, some_ranks=job.config.ranks is not None)
            else:
                self._held.lost()
                if not self._closed:
                    self.restarts += 1
                    self._records.new_ranks()
                    self._group = self._new_group()
                    job._note("session: restarted with fresh ranks; what earlier runs "
                              "defined is gone")
            if not self._closed:
                self._group.make_room(*job._data_bytes)
        finally:
            self._busy = False

    # --- the session's life ---------------------------------------------------------

    def restart(self) -> None:
        """Stop the ranks and start fresh ones: everything the session defined is gone.
        Ctrl-C meanwhile ends the session instead (no ranks are left running)."""
        with self._lock:
            self._check_idle()
            _, hold = held_while(self._replace_group)  # a press: stops old and new, not half
        self._wait_ready(hold)

    def _replace_group(self, standby: bool = True) -> None:
        """(Under the lock) Stop the ranks and start fresh ones (``standby``: waiting
        standby ranks may be taken): what the session defined is gone."""
        self._stop_group()
        self._held.lost()
        self.restarts += 1
        self._group = self._new_group(standby)
        self._records.new_ranks()

    def close(self) -> None:
        """Stop the ranks; nothing of the session is left running or on disk. Ctrl-C
        meanwhile is raised once they are stopped."""
        with interrupt_after():
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                running = self._running if self._busy else None
            if running is not None:
                running.cancel()
            with self._lock:
                self._stop_group()
                self._records.close()

    def _stop_group(self) -> None:
        self._group.stop()
        self._group.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def names(self) -> frozenset[str]:
        """The names the session's code has bound on the ranks (rank 0's): a cell that
        reads one of them gets the ranks' value, not the notebook's."""
        return self._held.bound

    def status(self) -> SessionStatus:
        """The ranks, their PIDs and memory, and the session's age."""
        group = self._group
        pids = {} if self._closed else group.rank_pids()
        backend = self.config.backend or ("gloo" if group.shape.prepare else "nccl")
        place = self._where.place(group)
        return SessionStatus(not self._closed, self.config.nprocs,
                             backend if self.config.init else "no process group",
                             time.monotonic() - self._started, self.runs, self.restarts,
                             pids, {rank: rss for rank, pid in pids.items()
                                    if not place and (rss := rss_mib(pid)) is not None},
                             place, self._where.hosts(group, self._running), self.auto,
                             self.reloads)

    def __repr__(self) -> str:
        return str(self.status())

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _as_sessions(group: G) -> G:
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
