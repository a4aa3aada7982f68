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

A session's ranks run on this machine (started by torchrun here, or taken from standby),
or, with ``slurm=``, as one SLURM job on the cluster's nodes (``_slurm.session``): the
session waits for the job to leave the queue, showing its state, and then every run is
handed to the job's ranks the same way.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO, TypeVar

from ._errors import NbddpError, WorkerError
from ._local.group import LocalGroup
from ._local.standby import STANDBY, START_TIMEOUT
from ._notebook.ipython_autoreload import notebook_autoreloads
from ._run.config import DEFAULT_STALL_AFTER, RunConfig, RunOptions
from ._run.group import RanksGone
from ._run.interrupt_hold import InterruptHold, held_while, interrupt_after
from ._run.job import Job
from ._run.rank_choice import chosen_ranks
from ._run.records import FolderPerCell, Records, SessionRecords, records_root
from ._run.shape import GroupShape
from ._run.supervisor import Ending, Supervisor
from ._run.waiting import WaitingGroup
from ._slurm.options import Slurm, SlurmOptions, cluster_run
from ._slurm.session import SessionRecord, SlurmSessionGroup, running_sessions
from ._slurm.step import Allocation
from ._wire.dataplane import Packed
from ._wire.kept_storages import kernels_copies
from ._wire.messages import Assigned, Failure, Result
from ._wire.payload import Payload
from ._wire.rundir import RunDir

R = TypeVar("R")
G = TypeVar("G", bound=WaitingGroup)

SETTLE_SECONDS = 10.0
"""How long a session's ranks may take to come back to rest after a failure, an
interrupt or a timeout before they are restarted (a rank stuck in a collective whose
peer left never comes back by itself)."""
ATTACH_WAIT = 30.0
"""How long the ranks of a session's job may take to reconnect to a kernel that attaches
(they look for it twice a second, once their last kernel has gone)."""
STATE_KEPT = "the session's ranks are back at rest, with their state"
STATE_LOST = "the session was restarted: variables defined in earlier cells are gone"


def with_session_note(error: BaseException, kept: bool) -> BaseException:
    """``error``, saying whether the session's state was kept."""
    note = STATE_KEPT if kept else STATE_LOST
    if isinstance(error, WorkerError):
        error.note = note
        return error
    message = str(error).replace("; every rank was stopped", "")
    if isinstance(error, KeyboardInterrupt):
        message = "every rank was interrupted" + (f"\n{message}" if message else "")
    first, newline, rest = message.partition("\n")  # (then where each rank was)
    renamed = type(error)(f"{first}; {note}{newline}{rest}" if first else note)
    renamed.__cause__ = error.__cause__
    for found in ("stacks", "hang_report"):  # what the run saw before it stopped the ranks
        if hasattr(error, found):
            setattr(renamed, found, getattr(error, found))
    return renamed


class _OnSession:
    """One run on the session's ranks, as its ``Job`` sees it (``Staying``): the names
    the ranks' code bound (the answering rank's report carries them), and whether the
    ranks stay for the next run, with their state."""

    def __init__(self, group: WaitingGroup) -> None:
        self._group = group
        self.kept: bool | None = None
        """Whether the ranks kept their state: None until the run's end decided it."""
        self.names: tuple[str, ...] | None = None

    def watch(self, supervisor: Supervisor) -> None:
        for kind in (Assigned, Result, Failure):
            supervisor.pump.on(kind, self._assigned)

    def _assigned(self, message: Assigned | Result | Failure) -> None:
        names = message.names if isinstance(message, Assigned) else message.assigned
        if names is not None:
            self.names = names

    def settle(self, supervisor: Supervisor, ending: Ending) -> bool:
        self.kept = ending.kind == "returned" or self._bring_back(supervisor)
        return self.kept

    def told(self, error: BaseException) -> BaseException:
        return with_session_note(error, bool(self.kept))

    def abandoned(self) -> bool:
        if self.kept is not None:
            return False
        self.kept = False
        return True

    def _bring_back(self, supervisor: Supervisor) -> bool:
        """Interrupt the ranks still in the run; True once every rank is back at rest,
        within ``SETTLE_SECONDS`` (which also wait for rank 0's names, sent right after
        its report)."""
        if supervisor.lost:
            return False
        everyone = set(range(supervisor.config.nprocs))
        self._group.interrupt(everyone - supervisor.attempt.reported)
        deadline = time.monotonic() + SETTLE_SECONDS

        def at_rest() -> bool:
            return supervisor.attempt.reported == everyone and not supervisor.lost

        supervisor.pump.run(lambda: at_rest() or supervisor.lost, SETTLE_SECONDS,
                            turn=supervisor.pump_output)
        if at_rest() and self.names is None:
            supervisor.pump.run(lambda: self.names is not None, deadline - time.monotonic())
        return at_rest()


@dataclass(frozen=True)
class SessionStatus:
    """What a session is running: its ranks, their PIDs and memory, its age."""

    open: bool
    nprocs: int
    backend: str
    uptime: float
    """Seconds since the current ranks started."""
    runs: int
    """Runs (cells) the session has run."""
    restarts: int
    """Times its ranks were replaced by fresh ones (state lost)."""
    pids: dict[int, int]
    """Each rank's process id."""
    rss_mib: dict[int, float]
    """Each rank's resident memory, in MiB (ranks on this machine)."""
    where: str = ""
    """Where the ranks run when not on this machine, e.g. ``SLURM job 12 on n[1-2]``."""
    hosts: dict[int, str] = dataclasses.field(default_factory=dict)
    """Each rank's machine (as its last run reported it, for ranks on a cluster)."""
    auto: bool = False
    """Auto mode: every cell runs on the ranks (``%ddp_session auto on``)."""
    autoreload: bool = False
    """The ranks reload the user's edited modules before each run."""

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def __str__(self) -> str:
        if not self.open:
            return "nbddp session: closed"
        minutes, seconds = divmod(int(self.uptime), 60)
        hours, minutes = divmod(minutes, 60)
        on = f" on {self.where}" if self.where else ""
        lines = [f"nbddp session: {self.nprocs} ranks ({self.backend}){on}, up "
                 f"{hours}:{minutes:02d}:{seconds:02d}, {self.runs} runs, "
                 f"{self.restarts} restarts; auto mode {'on' if self.auto else 'off'}, "
                 f"autoreload {'on' if self.autoreload else 'off'}"]
        for rank in range(self.nprocs):
            pid, rss, host = self.pids.get(rank), self.rss_mib.get(rank), self.hosts.get(rank)
            lines.append(f"  rank {rank}: pid {pid if pid else '(starting)'}"
                         + (f" on {host}" if host else "")
                         + (f", {rss:.0f} MiB resident" if rss is not None else ""))
        return "\n".join(lines)


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

    ``slurm=nbddp.Slurm(nodes=2, ...)`` starts them as one SLURM job instead,
    ``nprocs`` (or ``gpus``) ranks per node, and waits until the job runs (its state is
    shown meanwhile; Ctrl-C cancels it). Its ranks outlive the kernel for ``grace``
    seconds (None, the default: as long as the job runs; 0: they end with the kernel),
    and ``Session.attach(job_id)`` in a new kernel reconnects to them, state and all.
    ``close()`` cancels the job.
    """

    def __init__(self, nprocs: int | None = None, *, gpus: int | Sequence[int] | None = None,
                 backend: str | None = None, init: bool = True, timeout: float | None = None,
                 env: Mapping[str, str] | None = None,
                 output: Literal["rank0", "all", "none"] = "rank0",
                 slurm: bool | Slurm = False, grace: float | None = None) -> None:
        options = RunOptions(nprocs=nprocs, gpus=gpus, backend=backend, init=init,
                             timeout=timeout, env=env, output=output)
        if slurm is False:
            if grace is not None:
                raise ValueError("grace is for a session on SLURM (slurm=...): a local "
                                 "session's ranks end with the kernel")
            self._begin(options.on_this_machine(), None, None)
        else:
            config, cluster = cluster_run(options, _on_the_allocation(slurm))
            _check_session_job(cluster, grace)
            self._begin(config, cluster, grace)
        self._group, hold = held_while(self._new_group)  # a press: stops them once they exist
        self._wait_ready(hold)
        if self._cluster is not None:
            self._say_how_it_ends()

    @classmethod
    def attach(cls, job_id: str | int | None = None) -> Session:
        """The session whose SLURM job ``job_id`` holds the ranks, e.g. after a kernel
        restart: its ranks reconnect to this kernel, with their state. Without
        ``job_id``, this account's one running session job (several are listed in the
        error). Only the user who started the session can attach: the key is theirs."""
        found = running_sessions(None if job_id is None else str(job_id))
        if len(found) != 1:
            raise NbddpError(_no_single_session(found, job_id))
        record, run_dir = found[0]
        session = cls.__new__(cls)
        config = RunConfig(nprocs=record.nprocs, backend=record.backend, init=record.init,
                           timeout=record.timeout, output=record.output)
        session._begin(config, record.options, record.grace)
        group = SlurmSessionGroup.attached(session._cluster_shape().unknown(), run_dir,
                                           record)
        session._group = _as_sessions(group)
        try:
            ready = group.wait_ready(ATTACH_WAIT)
        except BaseException:  # Ctrl-C: the job stays for another try
            group.detach()
            raise
        if not ready:
            why = _not_attached(group, record.job_id)
            group.detach()
            raise NbddpError(why)
        session.names = frozenset(group.names or ())
        print(f"nbddp: attached to the session on SLURM job {record.job_id} "
              f"({record.nprocs} ranks, {len(session.names)} names kept on them)", flush=True)
        return session

    def _begin(self, config: RunConfig, cluster: SlurmOptions | None,
               grace: float | None) -> None:
        self.config = config
        self._cluster = cluster
        """The SLURM job's options, if the ranks run on a cluster."""
        self._grace = grace
        self._lock = threading.Lock()
        self._busy = False  # a run goes on (set before its Job exists, cleared at its end)
        self._warned: set[str] = set()
        self._running: Job | None = None
        self._records: SessionRecords | FolderPerCell = (
            SessionRecords(config.nprocs) if cluster is None
            else FolderPerCell(config.nprocs))
        self._closed = False
        self.runs = 0
        self.restarts = 0
        self.names: frozenset[str] = frozenset()
        """The names the session's code has bound on the ranks (rank 0's): a cell that
        reads one of them gets the ranks' value, not the notebook's."""
        self.auto = False
        """Auto mode (``%ddp_session auto on``): every cell runs on the ranks; the panel
        says so."""
        self.autoreload: bool | None = None
        """Reload the user's edited modules on the ranks before each run: True, False, or
        None, as the notebook's own ``%autoreload 2`` does (see ``reloads``)."""
        self._started = time.monotonic()

    def _cluster_shape(self) -> GroupShape:
        """The shape of the ranks on the cluster's nodes: their GPUs, not this machine's."""
        assert self._cluster is not None
        return dataclasses.replace(GroupShape.of(self.config), cuda_visible_devices=None,
                                   gpus=self._cluster.gpus_per_node)

    def _new_group(self, standby: bool = True) -> WaitingGroup:
        group: WaitingGroup
        if self._cluster is not None:
            group = SlurmSessionGroup.start(
                self._cluster_shape(), self._cluster, self._grace,
                {"timeout": self.config.timeout, "output": self.config.output})
        else:
            shape = GroupShape.of(self.config)
            taken = STANDBY.take(shape) if standby else None  # waiting ranks become the session's
            group = taken[0] if taken is not None else LocalGroup(shape)
        self._started = time.monotonic()
        return _as_sessions(group)

    def _wait_ready(self, hold: InterruptHold | None = None) -> None:
        """Block until every rank waits for its first run (Ctrl-C stops them, one held
        by ``hold`` while they started too)."""
        group = self._group
        try:
            if hold is not None:
                hold.release()
            if isinstance(group, SlurmSessionGroup):
                ready = _wait_for_job(group)
            else:
                ready = group.wait_ready(START_TIMEOUT)
        except KeyboardInterrupt:
            self.close()
            raise
        if not ready:
            self.close()
            problem = "stopped" if group.broken else f"were not ready after {START_TIMEOUT} s"
            outside = group.stopped_from_outside()
            because = f" ({outside})" if outside else ""
            raise NbddpError(f"the session's ranks {problem}{because} before their first run; "
                             f"{group.launcher_name} said:\n{group.launcher_tail()}")

    def _say_how_it_ends(self) -> None:
        job = self._group.slurm_job_id
        if self._grace == 0:
            return
        lasts = ("as long as the job runs" if self._grace is None
                 else f"for {self._grace:g} s")
        print(f"nbddp: the ranks outlive this kernel {lasts}: after a restart, "
              f"%ddp_session attach {job} (or nbddp.Session.attach({job!r})) reconnects; "
              "%ddp_session stop ends the job", flush=True)

    # --- runs -----------------------------------------------------------------------

    def run(self, fn: Callable[..., R], /, *args: Any, ranks: Sequence[int] | None = None,
            **kwargs: Any) -> R:
        """``fn(*args, **kwargs)`` on every rank, in the session's namespace; rank 0's
        value. ``ranks=[0]`` runs it on those ranks only (the others stay at rest, with
        their state; the value is the lowest one's; a collective in ``fn`` would wait for
        the others forever). Interrupting the wait interrupts the ranks."""
        __tracebackhide__ = True
        return Job.started_held(lambda: self.submit(fn, args, kwargs, ranks=ranks)).result()

    def run_all(self, fn: Callable[..., R], /, *args: Any, ranks: Sequence[int] | None = None,
                **kwargs: Any) -> list[R]:
        """Like ``run``, with every rank's value (each of ``ranks``'), in rank order."""
        __tracebackhide__ = True
        return Job.started_held(lambda: self.submit(fn, args, kwargs, all_ranks=True,
                                                    ranks=ranks)).result()

    def submit(self, fn: Callable[..., Any], args: Sequence[Any] = (),
               kwargs: Mapping[str, Any] | None = None, *, all_ranks: bool = False,
               timeout: float | None = None,
               output: Literal["rank0", "all", "none"] | None = None,
               stdout: TextIO | None = None,
               stall_after: float | None = DEFAULT_STALL_AFTER, pdb: bool = False,
               ranks: Sequence[int] | None = None) -> Job:
        """Hand one run to the ranks and return its ``Job`` at once (``%%ddp`` uses this).
        ``timeout`` and ``output`` default to the session's; ``pdb``: a rank that raises
        opens pdb in the notebook at the failing frame first (as ``launch``'s);
        ``ranks``: the ranks that run it (as ``run``'s)."""
        __tracebackhide__ = True
        config = dataclasses.replace(self.config, all_ranks=all_ranks,
                                     output=output or self.config.output,
                                     timeout=timeout or self.config.timeout,
                                     stall_after=stall_after, pdb=pdb,
                                     ranks=chosen_ranks(ranks, self.config.nprocs),
                                     autoreload=self.reloads)
        here = kernels_copies() if self._cluster is None else None
        payload = Payload.capture(fn, tuple(args), dict(kwargs or {})).dumps(here)
        return Job.started_held(lambda: self._start(config, payload, stdout))._handed_back()

    def _start(self, config: RunConfig, payload: Packed, stdout: TextIO | None) -> Job:
        """Hand the ranks the run, unless they are busy; its ``Job``."""
        with self._lock:
            self._check_idle()
            self._busy = True
            try:
                records = self._records.next_cell(self.runs + 1)
                warm = self._hand_over(config, payload, records)
                run = _OnSession(self._group)
                job: Job = Job(self._group, config, records, stdout=stdout, warm=warm,
                               sent=payload.buffer_bytes, staying=run,
                               after=lambda job: self._after_run(job, run),
                               where=_labelled(self._group.where, self.runs + 1, self.auto,
                                               config.autoreload))
                self._group.notice = None  # said once, under this run
            except BaseException:
                self._busy = False
                raise
            self._running = job
        self._records.prepare()
        return job

    @property
    def reloads(self) -> bool:
        """Whether the next run reloads the ranks' edited modules first: ``autoreload``,
        or where that is None, whether the notebook's ``%autoreload`` checks every module
        (``%autoreload 2`` or 3)."""
        return self.autoreload if self.autoreload is not None else notebook_autoreloads()

    def _hand_over(self, config: RunConfig, payload: Packed, records: Records) -> bool:
        """(Under the lock) Give the ranks the run; if one of their processes died while
        they were idle, give it to fresh ranks, and say so. True: the session's ranks
        (not fresh ones) took it."""
        try:
            self._hand_to(config, payload, records)
            return True
        except RanksGone as gone:
            self._replace_group(standby=False)
            lost = STATE_LOST if self.runs else "this first run starts on fresh ranks"
            self._group.notice = f"nbddp: session: {gone.why} while idle; {lost}"
        self._hand_to(config, payload, records)
        return False

    def _hand_to(self, config: RunConfig, payload: Packed, records: Records) -> None:
        group = self._group
        handover, left_out = group.shape.take_up(GroupShape.of(config))
        self._warn_left_out(left_out)
        group.hand_over(payload, records, config.rank_options, handover)

    def _warn_left_out(self, names: list[str]) -> None:
        """Once per variable: a notebook change the running ranks cannot take up."""
        new = [name for name in names if name not in self._warned]
        if new:
            self._warned.update(new)
            warnings.warn(f"{', '.join(new)} changed in the notebook, but the session's ranks "
                          "read them when they started: restart the session "
                          "(%ddp_session restart) for the new values", stacklevel=3)

    def _check_idle(self) -> None:
        if self._closed:
            raise NbddpError("this session is closed; start another one")
        if self._busy:
            raise NbddpError("the session's ranks are still running the last run; wait "
                             "for it (job.result()) or cancel it first")

    def _after_run(self, job: Job, run: _OnSession) -> None:
        """A run ended: keep the ranks' names, or start fresh ranks if they were lost.
        The next run's rooms are made as large as this one's data (the next cell likely
        sends and gets as much again)."""
        self.runs += 1
        if isinstance(self._group, SlurmSessionGroup) and self._group.detached:
            self._closed = True  # the kernel left the job for another: nothing to restart
        try:
            if run.kept:
                self._group.payload_taken()
                if run.names is not None:  # (a run on some ranks adds to what the others had)
                    before = self.names if job.config.ranks is not None else frozenset()
                    self.names = before | frozenset(run.names)
            else:
                self.names = frozenset()
                self._warned.clear()
                if not self._closed:
                    self.restarts += 1
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
        self.names = frozenset()
        self._warned.clear()
        self.restarts += 1
        self._group = self._new_group(standby)

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

    def status(self) -> SessionStatus:
        """The ranks, their PIDs and memory, and the session's age."""
        group = self._group
        pids = {} if self._closed else group.rank_pids()
        backend = self.config.backend or ("gloo" if group.shape.prepare else "nccl")
        place = _job_place(group) if isinstance(group, SlurmSessionGroup) else ""
        return SessionStatus(not self._closed, self.config.nprocs,
                             backend if self.config.init else "no process group",
                             time.monotonic() - self._started, self.runs, self.restarts,
                             pids, {rank: rss for rank, pid in pids.items()
                                    if not place and (rss := _rss_mib(pid)) is not None},
                             place, self._hosts(place), self.auto, self.reloads)

    def _hosts(self, place: str) -> dict[int, str]:
        """This machine's name for local ranks; on a cluster, as the last run said."""
        if not place:
            return dict.fromkeys(range(self.config.nprocs), socket.gethostname())
        last = self._running
        return {} if last is None else {rank: info["host"] for rank, info in last.ranks.items()
                                        if info["host"]}

    def __repr__(self) -> str:
        return str(self.status())

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


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


def _check_session_job(options: SlurmOptions, grace: float | None) -> None:
    """What a batch run may ask of SLURM that a session's job cannot do (yet)."""
    asked = [name for name, value in (("requeue", options.requeue),
                                      ("signal_before", options.signal_before),
                                      ("max_restarts", options.max_restarts)) if value]
    if asked:
        raise ValueError(f"a session's SLURM job does not take {', '.join(asked)}: its ranks "
                         "keep state that a restart would lose")
    if grace is not None and (isinstance(grace, bool) or not isinstance(grace, (int, float))
                              or grace < 0):
        raise ValueError(f"grace is a number of seconds, 0 or more (or None), got {grace!r}")


def _on_the_allocation(slurm: bool | Slurm) -> bool | Slurm:
    """Where the kernel runs in an allocation, the session's job step takes all of its
    nodes (``Allocation.check`` refuses other choices)."""
    allocation = Allocation.here()
    if allocation is None:
        return slurm
    chosen = Slurm() if slurm is True else slurm
    if not isinstance(chosen, Slurm):
        return slurm  # (cluster_run says what is wrong with it)
    allocation.check(chosen.options(1, 0))
    return dataclasses.replace(chosen, nodes=allocation.nodes)


def _not_attached(group: SlurmSessionGroup, job_id: str) -> str:
    """Why the ranks of a session's job did not come to a kernel that attached."""
    if group.broken:
        return f"SLURM job {job_id} ended before its ranks came back"
    if group.status.state == "PENDING":
        return (f"SLURM job {job_id} waits in the queue ({group.status.reason}): its "
                "ranks are gone; stop it, and start a new session")
    return (f"the ranks of SLURM job {job_id} did not come within {ATTACH_WAIT:g} s: another "
            "kernel still attached to them keeps them (stop or restart it first), or they "
            "are still finishing the cell that was running")


def _no_single_session(found: list[tuple[SessionRecord, RunDir]],
                       job_id: str | int | None) -> str:
    """Why ``Session.attach`` cannot choose: no session job runs, or several do."""
    if not found:
        which = f"SLURM job {job_id} is not" if job_id is not None else "no SLURM job is"
        return (f"{which} a running session of this account (under {records_root()}); "
                "start one with %ddp_session start --slurm")
    lines = [f"  SLURM job {record.job_id}: {_count(record.nprocs, 'rank')} on "
             f"{_count(record.options.nodes, 'node')}, started "
             f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(record.started))}"
             for record, _ in found]
    return ("several session jobs run; attach to one by its id "
            "(%ddp_session attach JOBID):\n" + "\n".join(lines))


def _wait_for_job(group: SlurmSessionGroup) -> bool:
    """Wait for a session's job to leave the queue and for its ranks to be ready,
    saying each change of the job's state; True once every rank waits. The time in
    the queue is unbounded (Ctrl-C cancels); the ranks' start, ``START_TIMEOUT``."""
    running_since = None
    if group.step_of is not None:
        print(f"nbddp: the session's ranks start as a job step of SLURM allocation "
              f"{group.step_of.job_id} ({group.step_of.nodelist})", flush=True)
    while not group.wait_ready(0.1) and not group.broken:
        for line in group.take_unsaid():
            print(line, flush=True)
        if group.status.state == "RUNNING" and running_since is None:
            running_since = time.monotonic()
        if running_since is not None and time.monotonic() - running_since > START_TIMEOUT:
            return False
    for line in group.take_unsaid():
        print(line, flush=True)
    return group.is_ready


def _job_place(group: SlurmSessionGroup) -> str:
    nodes = group.status.nodes
    return f"SLURM job {group.slurm_job_id}" + (f" on {nodes}" if nodes else "")


def _count(number: int, thing: str) -> str:
    return f"{number} {thing}" + ("" if number == 1 else "s")
