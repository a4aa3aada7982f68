"""What a rank does with each ``Start``: take up the run, run the user's code, report.

A one-off run ends the rank. A session's rank goes back to rest after each run and
keeps what its code built: one ``Scope`` for the notebook code it runs, and the default
process group, set up for the first run and kept. A session's run given to some ranks
only leaves the others at rest, untouched. The kernel interrupts a session's run
(the rank sends itself SIGINT), which raises ``KeyboardInterrupt`` in the user's code
(never in nbddp's).
"""

from __future__ import annotations

import bdb
import contextlib
import dataclasses
import os
import secrets
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Protocol, runtime_checkable

from .._version import __version__
from .._wire import dataplane
from .._wire.messages import (
    Assigned,
    Failure,
    RankOptions,
    Requeueing,
    Result,
    SnapshotTaken,
    Start,
)
from .._wire.payload import Payload, dumps_value
from .._wire.rank_stats import RankStats
from .._wire.rundir import NODE_DISK_ENV, NODE_SHM_ENV
from .._wire.snapshot_orders import RestoreNote, SnapshotOrder
from . import debugger, setup_check
from .autoreload import Reloader, forget_listings, ready_to_reload
from .metrics import start_reporting, stop_reporting
from .requeue import RequeueRequested, mark_requeue
from .scope import Scope
from .snapshot import Snapshots
from .stats import use_device
from .whole import make_whole

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
LET_THE_KERNEL_END = 0.02
"""Seconds a rank's work at rest (a snapshot, autoreload's look at the modules) waits
after its report, while the kernel ends the run: where the ranks fill the machine's
cores, that work at once slows the end of every cell (``bench_snapshots.py`` measures
it)."""


@dataclass(frozen=True)
class Report:
    """How a run went (``Result``, ``Failure`` or ``Requeueing``), and the data file its
    result sends along to a kernel on another machine, if any."""

    message: Result | Failure | Requeueing
    data: dataplane.Packed | None = None


def code_home(run_dir: Path) -> Path:
    """Where the user's modules shipped to this rank are written: the node's private
    folder on local disk (or in shared memory), which its torchrun removes, where
    nbddp's torchrun made one; else the rank's run folder, which goes with the run."""
    node = os.environ.get(NODE_DISK_ENV) or os.environ.get(NODE_SHM_ENV)
    return Path(node) if node else run_dir


def _packed_payload(start: Start) -> dataplane.Packed:
    """The run's payload: in the Start itself, or mapped from its data file."""
    if start.packed is not None:
        return dataplane.Packed(start.packed)
    return dataplane.read(Path(start.payload))


@runtime_checkable
class RunsInScope(Protocol):
    """Notebook code that runs in a rank's scope itself (a cell)."""

    def run_in(self, scope: Scope) -> Any: ...


class Interrupts:
    """SIGINT raises ``KeyboardInterrupt`` in the user's code, and only there.

    One that comes while the rank takes up a run, before the user's code starts (its
    Start still queued, the payload unpacked, the process group joined), is kept and
    raised as that code starts: the kernel sends an interrupt once, and a rank that
    dropped it would run the whole cell. One that comes after the user's code, or at
    rest, is dropped.
    """

    def __init__(self, in_run: Callable[[], bool]) -> None:
        self._in_run = in_run
        self._armed = False
        self._pending = False
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._armed:
            raise KeyboardInterrupt
        if self._in_run():
            self._pending = True

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def raise_kept(self) -> None:
        """(Armed, as the user's code is about to start) Raise the interrupt that came
        while the rank took up the run, if one did. It is raised here, in nbddp's frame,
        so that its traceback holds no code of the user's, nor of ``contextlib``:
        nothing for ``%ddp_debug`` to keep, nothing for an error to show."""
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt

    def forget(self) -> None:
        """The run is over (and the rank no longer in it): a kept interrupt is dropped."""
        self._pending = False


class Rank:
    """One rank's state across the runs it is given."""

    def __init__(self, rank: int, run_dir: Path, log: Path, prepared: str | None,
                 move_log: Callable[[Path, Path], None], in_run: Callable[[], bool]) -> None:
        self.rank, self.run_dir, self.log, self.prepared = rank, run_dir, log, prepared
        self._move_log = move_log
        self._group_ready = False
        self.scope = Scope()
        self.interrupts = Interrupts(in_run)
        self.reloader: Reloader | None = None  # made when a session's run first asks for it
        self._ready_to_reload = False
        self._final_stats: RankStats | None = None  # this run's, as it ended
        self._records: str | None = None  # the records folder the log was last moved to
        self.snapshots = Snapshots(rank)
        self._restored: RestoreNote | None = None  # this run's, from a snapshot
        self._snapshot_due: tuple[SnapshotOrder, bool] | None = None  # (at rest)

    def run(self, start: Start, send: Callable[[Any], None]) -> Report:
        """Take up ``start``'s run, run it, and say how it went (never raises); the
        report carries the rank's stats as the run ended, if it ran, and a session's
        answering rank's names (one message, not two: the kernel takes in each)."""
        self._final_stats, self._restored = None, None
        report = self._run(start, send)
        message = report.message
        said: dict[str, Any] = {}
        if self._final_stats is not None:
            said["stats"] = self._final_stats
        if start.session and self.rank == start.options.answering:
            said["assigned"] = tuple(sorted(self.scope.assigned))
        if self._restored is not None:
            said["restored"] = self._restored
        order = start.options.snapshot
        if order is not None and isinstance(message, Result):
            self._snapshot_due = (order, start.options.runs_on(self.rank))
        elif start.session and start.options.runs_on(self.rank):
            self.snapshots.ran_without()  # (its last snapshot no longer holds its state)
        if isinstance(message, (Result, Failure)):
            return Report(dataclasses.replace(message, **said), report.data) if said else report
        if "assigned" in said:  # (a SLURM job's rank asking to be requeued)
            send(Assigned(self.rank, said["assigned"]))
        return report

    def _run(self, start: Start, send: Callable[[Any], None]) -> Report:
        reporter = None
        answering = start.options.answering
        try:
            self._adopt(start)
            setup_check.remember_launch()
            if start.options.restore is not None:  # (fresh ranks: before any cell)
                self._join_group(start)
                self._restored = self.snapshots.restore(self.scope, start.options.restore)
            if not start.options.runs_on(self.rank):
                return Report(Result(self.rank))  # at rest, state untouched
            reporter = start_reporting(self.rank, send)
            payload = Payload.unpack(_packed_payload(start), code_home(self.run_dir))
            if debugger.DEBUGGING and not getattr(payload.fn, "keeps_last_failure", False):
                debugger.DEBUGGING.last_failure = None  # (its frames may hold much memory)
            scope = self.scope if start.session else Scope()
            if start.session and start.options.autoreload:
                self.reloader = self.reloader or Reloader()
                self.reloader.check()  # (a failure: before the cell, which does not run)
            with scope.tracking():
                value = self._call(payload, start, scope)
            wanted = self.rank == answering or start.options.all_ranks
            return self._result(value, start) if wanted else Report(Result(self.rank))
        except RequeueRequested:
            mark_requeue()
            return Report(Requeueing(self.rank))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the kernel
            if isinstance(exc, SystemExit) and exc.code in (None, 0):
                return Report(Result(self.rank,
                                     dumps_value(None) if self.rank == answering else None))
            self._debug(exc, start)
            return Report(failure(self.rank, exc))
        finally:
            for stream in (sys.stdout, sys.stderr):  # a line without its end yet is
                with contextlib.suppress(Exception):  # this run's (a full disk, a
                    stream.flush()  # closed stream: not the rank's end)
            if reporter is not None:  # what is still buffered goes before the report
                self._final_stats = stop_reporting()
            if self.reloader is not None and start.options.autoreload:
                self.reloader.note_new()  # what the cell imported, as it is now

    def at_rest(self, send: Callable[[Any], None], rests_for: Callable[[float], None]) -> None:
        """The run is reported and the rank waits for the next: its snapshot is taken and
        written (``_rank.snapshot``), and the kernel told; with autoreload on, get ready
        to reload (while the user types, not in the cell after an edit; where that
        fails, the reload itself says why). That work waits ``LET_THE_KERNEL_END`` first
        (``rests_for``, cut short by the next Start, which it comes before)."""
        if self._snapshot_due is None and (self.reloader is None or self._ready_to_reload):
            return
        rests_for(LET_THE_KERNEL_END)
        if self._snapshot_due is not None:
            self._snapshot(send)
        if self.reloader is not None and not self._ready_to_reload:
            self._ready_to_reload = True
            with contextlib.suppress(Exception):
                ready_to_reload()

    def _snapshot(self, send: Callable[[Any], None]) -> None:
        """Take and write the snapshot the last run asked for; tell the kernel. A failure
        is said on the rank's output: the kernel finds no snapshot of that cell here."""
        assert self._snapshot_due is not None
        (order, ran), self._snapshot_due = self._snapshot_due, None
        try:
            note = self.snapshots.keep(self.scope, order, ran)
        except Exception as exc:  # noqa: BLE001 - the rank goes on without it
            self.snapshots.ran_without()
            print(f"nbddp: rank {self.rank} could not take its snapshot of cell {order.cell}"
                  f" ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
            return
        send(SnapshotTaken(self.rank, note))

    def _debug(self, exc: BaseException, start: Start) -> None:
        """Post-mortem on the user's part of ``exc``'s traceback if the run asked for it,
        before the failure is reported (and the kernel stops the ranks); a session's rank
        keeps it for ``%ddp_debug``."""
        debugging = debugger.DEBUGGING  # (installed by the worker)
        if debugging is None:
            return
        users = users_part(exc.__traceback__)
        if start.session:
            debugging.keep(exc, users)
        if not start.options.post_mortem or users is None or not isinstance(
                exc, Exception) or isinstance(exc, bdb.BdbQuit):  # (q at a breakpoint)
            return
        try:
            debugging.post_mortem(exc, users)
        except BaseException as broken:  # noqa: BLE001 - the failure is reported all the same
            print(f"nbddp: post-mortem on rank {self.rank} ended: "
                  f"{type(broken).__name__}: {broken}", file=sys.stderr, flush=True)

    def _result(self, value: Any, start: Start) -> Report:
        """The report of a value: in the message, or its tensor and array bytes in a
        data file (in shared memory if it fits), which the kernel maps and removes; to a
        kernel on another machine, the file goes along with the message."""
        try:
            packed = dataplane.pack(value, to_cpu=True)
        except Exception as exc:
            raise TypeError(f"the function's return value cannot be sent back to the "
                            f"notebook: {type(exc).__name__}: {exc}") from exc
        if not packed.buffers:
            return Report(Result(self.rank, packed.data))
        if start.remote:
            return Report(Result(self.rank), packed)
        shm = Path(start.data) if start.data else None
        folder = dataplane.place(dataplane.size_of(packed), self.run_dir, shm)
        path = folder / f"result-{self.rank}-{secrets.token_hex(4)}.data"
        answering = self.rank == start.options.answering
        room = folder / dataplane.RESULT_ROOM if folder == shm and answering else None
        dataplane.write(path, packed, room)  # into the room the kernel allocated, if any
        return Report(Result(self.rank, file=str(path)))

    def _adopt(self, start: Start) -> None:
        """Take up the run: the notebook's nbddp, its records, directory and environment."""
        if start.version != __version__:
            raise RuntimeError(
                f"this rank runs nbddp {__version__} ({sys.executable}), but the notebook "
                f"sent its code with nbddp {start.version}: install the same nbddp where "
                "the ranks run")
        if start.records != self._records:  # (a session's cells share a folder)
            log = Path(start.records) / self.log.name
            if log != self.log:
                self._move_log(self.log, log)
                self.log = log
            self._records = start.records
        if start.cwd is not None and start.cwd != os.getcwd() and os.path.isdir(start.cwd):
            started_in = os.getcwd()  # (a node that cannot see the notebook's folder
            os.chdir(start.cwd)  # stays where it is: its modules ship all the same)
            if sys.path and sys.path[0] == started_in:  # `python -m` put the old one first
                sys.path[0] = start.cwd
        for name, value in start.env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        forget_listings()  # modules written in the notebook since the last run

    def _join_group(self, start: Start) -> None:
        """The default process group the run expects, made or kept."""
        if not self._group_ready:
            _process_group(start.options, self.prepared)
            self._group_ready = start.session  # a session keeps it; a one-off run ends it

    def _call(self, payload: Payload, start: Start, scope: Scope) -> Any:
        """The user's code, in the process group it expects."""
        self._join_group(start)
        fn = payload.fn
        runs_in_scope = getattr(fn, "run_in", None)  # (a RunsInScope: the protocol's own
        with self.interrupts.armed():  # isinstance is a tenth of a run's time)
            self.interrupts.raise_kept()
            if runs_in_scope is not None:
                value = runs_in_scope(scope)
            elif start.session:
                value = scope.bind(fn)(*payload.args, **payload.kwargs)
            else:
                value = fn(*payload.args, **payload.kwargs)
        value = _whole(value, start.options.all_ranks)  # (collective: while the group is up)
        if start.options.init and not start.session:  # (after success only: a rank
            import torch.distributed as dist  # that failed reports at once)

            if dist.is_initialized():
                dist.destroy_process_group()
        return value


def _whole(value: Any, all_ranks: bool) -> Any:
    """``value`` with its models and DTensors whole (see ``_rank.whole``); a cell's value and
    each of its ``--out`` names on their own, on every rank in the same order."""
    cell = sys.modules.get("nbddp._rank.cell")  # loaded by a cell's payload, not by a function's
    if cell is not None and isinstance(value, cell.CellResult):
        return cell.CellResult(make_whole(value.value, all_ranks, "the cell's value"),
                               {name: make_whole(output, all_ranks, name)
                                for name, output in value.outputs.items()})
    return make_whole(value, all_ranks)


def prepare(backend: str | None) -> str | None:
    """Import torch, and join the default process group if the kernel expects gloo."""
    import torch.distributed  # noqa: F401 - imported while the rank waits, not in its run

    if backend != "gloo":
        return None  # NCCL waits for Start: no CUDA context, no communicator while idle
    _join("gloo")
    return "gloo"


def _process_group(options: RankOptions, prepared: str | None) -> None:
    """The default process group the user's function expects, reusing a prepared one."""
    import torch
    import torch.distributed as dist

    if not options.init:
        if prepared:
            dist.destroy_process_group()
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = (options.backend != "gloo" and torch.cuda.is_available()
              and local_rank < torch.cuda.device_count())
    if on_gpu:
        torch.cuda.set_device(local_rank)
        use_device(local_rank)  # the reporting thread's stats read this GPU, not the first
    backend = options.backend or ("nccl" if on_gpu else "gloo")
    if prepared == backend:
        return
    if prepared:
        dist.destroy_process_group()
    _join(backend)


def _join(backend: str) -> None:
    """Join the default process group, and wait until every rank has joined: a rank
    whose code returns at once would otherwise exit while a peer still connects its
    gloo mesh, and that peer fails ("Gloo connectFullMesh failed ... Connection closed
    by peer"). torch's own barrier after the init (``TORCH_DIST_INIT_BARRIER``) waits
    on the store, not in the group: the user's first collective is still #1."""
    import torch.distributed as dist

    before = os.environ.get(_INIT_BARRIER)
    os.environ[_INIT_BARRIER] = "1"
    try:
        dist.init_process_group(backend)
    finally:
        if before is None:
            del os.environ[_INIT_BARRIER]
        else:
            os.environ[_INIT_BARRIER] = before


_INIT_BARRIER = "TORCH_DIST_INIT_BARRIER"


def users_part(tb: TracebackType | None) -> TracebackType | None:
    """A traceback from where it enters the user's code (nbddp's own frames left out)."""
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        tb = tb.tb_next
    return tb


def failure(rank: int, exc: BaseException) -> Failure:
    """Describe ``exc`` with a traceback that starts in the user's code, not in nbddp."""
    text = "".join(traceback.format_exception(type(exc), exc, users_part(exc.__traceback__)))
    try:
        pickled = dumps_value(exc)
    except Exception:
        pickled = None
    kind = type(exc)
    return Failure(rank, kind.__qualname__, kind.__module__, str(exc), text, pickled)
