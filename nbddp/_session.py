"""Sessions: ranks that keep their state from one run to the next.

A session is one rank group whose ranks go back to rest after each run instead of
exiting. Each rank keeps one namespace for the notebook code it runs (see ``_rank.scope``),
and its process group. Runs are handed to the group one at a time; each is a ``Job``
with its own records, panel and history. A run that ends early (a rank raised, an
interrupt, a timeout) keeps the ranks if every one comes back to rest; otherwise, and
when a rank dies, the ranks are stopped, fresh ones start, and the error says that the
state is gone. An idle session waits as long as it is open; if one of its processes dies
meanwhile, the next run finds out before it starts (the ranks' roll call, see
``_run.groups.waiting``), and runs on fresh ranks, saying that the state is gone.

Where the ranks run is the backend's (``_run.backend``, chosen in ``_backends``): on this
machine (started by torchrun here, or taken from standby), or on a cluster's nodes (one
SLURM job, one Ray placement group), which the session waits for, showing its state.
Every run is handed to the ranks the same way.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TextIO, TypeVar

from ._backends import Ray, Slurm, attached_session, chosen_cluster, session_backend
from ._notebook.ipython_autoreload import notebook_autoreloads
from ._run.config import (
    DEFAULT_STALL_AFTER,
    ClusterOptions,
    ConfigPerRun,
    RunConfig,
    RunOptions,
)
from ._run.groups.waiting import WaitingGroup
from ._run.interrupt_hold import InterruptHold, held_while, interrupt_after
from ._run.job import Job, followed_after_all, handed_back
from ._run.session.rank_choice import chosen_ranks
from ._run.session.ranks import SessionRanks, check_snapshots
from ._run.session.status import SessionStatus
from ._wire.payload import Payload

R = TypeVar("R")

class Session:
    """Ranks that keep their state between runs: variables, models, data loaders, the
    process group.

    ``Session(nprocs=2)`` starts the ranks (as ``launch`` would: ``gpus``, ``backend``,
    ``init``, ``env``). ``run(fn, *args, **kwargs)`` runs ``fn`` on every rank and
    returns rank 0's value, ``run_all`` every rank's. Globals that session code assigns
    (``global model; model = ...``, or a ``%%ddp`` cell's names) stay on the ranks for
    the next run. ``timeout`` bounds each run. A failing rank raises ``WorkerError``;
    the error says whether the ranks kept their state or were restarted. ``close()``
    (or leaving a ``with`` block) stops them; so does the kernel's end. With
    ``snapshots=True``, fresh ranks that replace lost ones load the last cell's names back.

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
                 snapshots: bool | int | str = False, slurm: bool | Slurm = False,
                 ray: bool | Ray = False) -> None:
        options = RunOptions(nprocs=nprocs, gpus=gpus, backend=backend, init=init,
                             timeout=timeout, env=env, output=output)
        chosen = chosen_cluster(cluster, slurm, ray)
        where = session_backend(options, chosen, grace)
        if snapshots is not False:
            check_snapshots(where, snapshots)  # (before a job is submitted for nothing)
        # (a press: stops them once they exist)
        ranks, hold = held_while(functools.partial(SessionRanks.start_on, where))
        self._begin(ranks)
        self._wait_ready(hold)
        where.started(self._group)
        if snapshots is not False:
            try:
                self.snapshots = snapshots
            except BaseException:
                self.close()
                raise

    @classmethod
    def attach(cls, job_id: str | int | None = None) -> Session:
        """The session whose SLURM job ``job_id`` (or Ray session, ``ray-...``) holds the
        ranks, e.g. after a kernel restart: its ranks reconnect to this kernel, with their
        state. Without ``job_id``, this account's one running session (several are
        listed in the error). Only the user who started the session can attach: the key
        is theirs."""
        where, group, names = attached_session(job_id)
        session = cls.__new__(cls)
        session._begin(SessionRanks(where, group, names))
        return session

    def _begin(self, ranks: SessionRanks) -> None:
        self._ranks = ranks
        self.config = ranks.where.config
        self._lock = threading.Lock()
        self.auto = False
        """Auto mode (``%ddp_session auto on``): every cell runs on the ranks; the panel
        says so."""
        self.autoreload: bool | None = None
        """Reload the user's edited modules on the ranks before each run: True, False, or
        None, as the notebook's own ``%autoreload 2`` does (see ``reloads``)."""
        self._configs = ConfigPerRun()

    @property
    def _group(self) -> WaitingGroup:  # (the group that holds the ranks now)
        return self._ranks.group

    @property
    def snapshots(self) -> bool:
        """Whether the ranks' names are kept after each cell that ends well on every rank,
        in this machine's shared memory, so that fresh ranks that replace lost ones (a rank
        killed, a process group aborted) load them back before the next cell. Set it to
        True, False, or a cap (``"8GiB"``; default: a quarter of the memory free)."""
        return self._ranks.snapshots.on

    @snapshots.setter
    def snapshots(self, setting: bool | int | str) -> None:
        self._ranks.keep_snapshots(setting)

    @property
    def runs(self) -> int:
        """Runs the session has handed its ranks."""
        return self._ranks.runs

    @property
    def restarts(self) -> int:
        """Times the session's ranks were replaced by fresh ones."""
        return self._ranks.restarts

    def _wait_ready(self, hold: InterruptHold | None = None) -> None:
        """Block until every rank waits for its first run; stop them if they do not come,
        or on Ctrl-C (one held by ``hold`` while they started too)."""
        try:
            self._ranks.wait_ready(hold)
        except BaseException:
            self.close()
            raise

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
        return handed_back(self._submitted(fn, args, kwargs, config, stdout))

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

    def _start(self, fn: Callable[..., Any], args: Sequence[Any],
               kwargs: Mapping[str, Any] | None, config: RunConfig, stdout: TextIO | None,
               caller_waits: bool) -> Job:
        """Pickle the run and hand it to the ranks, unless they are busy; its ``Job``."""
        payload = Payload.capture(fn, tuple(args), dict(kwargs or {}))
        packed = self._ranks.packed(payload, config)
        with self._lock:
            job = self._ranks.handed(config, payload, packed, stdout=stdout,
                                     caller_waits=caller_waits, auto=self.auto)
        try:
            self._ranks.records.prepare()
        except BaseException:
            followed_after_all(job)  # (nobody will wait for the run: it still ends)
            raise
        return job

    @property
    def reloads(self) -> bool:
        """Whether the next run reloads the ranks' edited modules first: ``autoreload``,
        or where that is None, whether the notebook's ``%autoreload`` checks every module
        (``%autoreload 2`` or 3)."""
        return self.autoreload if self.autoreload is not None else notebook_autoreloads()

    # --- the session's life ---------------------------------------------------------

    def restart(self) -> None:
        """Stop the ranks and start fresh ones: everything the session defined is gone.
        Ctrl-C meanwhile ends the session instead (no ranks are left running)."""
        with self._lock:
            self._ranks.check_idle()
            _, hold = held_while(self._ranks.replace)  # a press: stops old and new, not half
        self._wait_ready(hold)

    def close(self) -> None:
        """Stop the ranks; nothing of the session is left running or on disk. Ctrl-C
        meanwhile is raised once they are stopped."""
        with interrupt_after():
            with self._lock:
                ranks = self._ranks
                if ranks.closed:
                    return
                ranks.closed = True
                running = ranks.running if ranks.busy else None
            if running is not None:
                running.cancel()
            with self._lock:
                self._ranks.close()
                self._ranks.records.close()

    @property
    def closed(self) -> bool:
        return self._ranks.closed

    @property
    def names(self) -> frozenset[str]:
        """The names the session's code has bound on the ranks (rank 0's): a cell that
        reads one of them gets the ranks' value, not the notebook's."""
        return self._ranks.held.bound

    def status(self) -> SessionStatus:
        """The ranks, their PIDs and memory, and the session's age."""
        return self._ranks.status(not self._ranks.closed, self.auto, self.reloads)

    def __repr__(self) -> str:
        return str(self.status())

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
