"""``Job``: one run from start to teardown, supervised in a background thread.

The supervisor reads the channel's messages, forwards rank 0's output, and decides
how the run ends: every rank returned (success), a rank raised or died (the first one
is the root cause), a timeout, or a cancel. Whatever the ending, it stops every
process, closes the channel and removes the run directory before anyone is told.

A run submitted to SLURM is followed the same way: its launcher is the batch job
(stopped with ``scancel``), and its ranks' messages also arrive through their mailbox
files, which is how a restarted kernel re-attaches to it.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import sys
import threading
import time
from concurrent.futures import CancelledError
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TextIO, TypeVar

from ._channel import (
    ChannelServer,
    Disconnected,
    Failure,
    Hello,
    Metrics,
    Result,
    Sequenced,
    new_key,
)
from ._config import RunConfig
from ._diagnosis import diagnose, peer_lost
from ._display import Panel, PanelState, make_panel
from ._errors import NbddpError
from ._export import SlurmOptions
from ._history import History, read_history
from ._mailbox import MailboxReader
from ._output import BoundedOutput, LogTail
from ._payload import loads_value
from ._process import Launcher
from ._rundir import RunDir
from ._slurm import JobStatus, SlurmLauncher, kernel_host, read_shape, submit

logger = logging.getLogger(__name__)
R = TypeVar("R")

_PUMP_INTERVAL = 0.05
_REFRESH_INTERVAL = 0.1  # the panel redraws at most ten times a second
_DEATH_REPORT_WAIT = 2.0  # how long torchrun may take to report a rank that died


@dataclass(frozen=True)
class _LauncherExited:
    code: int


@dataclass(frozen=True)
class _Wake:
    """Sent to the supervisor so it notices a cancel at once."""


class Job(Generic[R]):
    """A launched run. ``result()`` waits for it; ``cancel()`` stops it; ``done()`` asks."""

    slurm_job_id: str | None = None
    """The SLURM job id of a run submitted with ``slurm=``; None for a local run."""

    def __init__(self, config: RunConfig, payload: bytes, stdout: TextIO | None = None,
                 slurm: SlurmOptions | None = None) -> None:
        self._prepare(config, RunDir.create() if slurm is None else RunDir.create_shared())
        try:
            self._start(payload, stdout or sys.stdout, slurm)
        except BaseException:  # whatever got started is stopped again
            self._teardown((False, None))
            raise

    @classmethod
    def _attach(cls, run_dir: RunDir, stdout: TextIO | None = None) -> Job:
        """Follow a submitted SLURM job again, from its run folder (after a restart)."""
        shape = read_shape(run_dir)
        job: Job = cls.__new__(cls)
        job._prepare(RunConfig(nprocs=shape["nprocs"], all_ranks=shape["all_ranks"],
                               output=shape["output"]), run_dir)
        try:
            run_dir.metrics.unlink(missing_ok=True)  # rebuilt from the mailboxes
            job._open_panel(stdout or sys.stdout)
            job._follow(shape["job_id"], attached=True)
            job._begin()
        except BaseException:
            job._teardown((False, None))
            raise
        return job

    def _prepare(self, config: RunConfig, run_dir: RunDir) -> None:
        self.config = config
        self._events: queue.Queue = queue.Queue()
        self._finished = threading.Event()
        self._cancel_reason: str | None = None
        self._outcome: tuple[bool, Any] | None = None
        self._results: dict[int, Result] = {}
        self._failures: list[Failure | Disconnected] = []
        self._next_seq: dict[int, int] = {}  # per rank: the next message number expected
        self._tails: list[LogTail]
        self._server: ChannelServer
        self._launcher: Launcher | SlurmLauncher  # these exist once started; teardown checks
        self._panel: Panel
        self._mailbox: MailboxReader | None = None
        self._run_dir = run_dir
        self._started = time.monotonic()

    def _start(self, payload: bytes, stdout: TextIO, slurm: SlurmOptions | None) -> None:
        key = new_key()
        self._run_dir.write_private(self._run_dir.key, key)
        self._run_dir.write_private(self._run_dir.payload, payload)
        self._open_panel(stdout)
        if slurm is None:
            self._server = ChannelServer(self._run_dir.socket, key, self._events)
            self._launcher = Launcher(self._run_dir, self.config)
        else:
            self._server = ChannelServer(("", 0), key, self._events)
            self._run_dir.write_private(self._run_dir.address,
                                        f"{kernel_host()} {self._server.port}".encode())
            self._follow(submit(self._run_dir, self.config, slurm))
        self._begin()

    def _open_panel(self, stdout: TextIO) -> None:
        self._history = History(self.config.nprocs, self._run_dir.metrics)
        self.state = PanelState(self.config.nprocs, self._history, str(self._run_dir.records))
        self._panel = make_panel(stdout)
        self._output = BoundedOutput(self._panel.write, self._run_dir.records)
        self._tails = self._make_tails(self._output)

    def _follow(self, job_id: str, attached: bool = False) -> None:
        """Follow a SLURM job: its state, and its ranks' mailbox files."""
        self.slurm_job_id = job_id
        self.state.where = f"SLURM job {job_id}"
        self.state.status = "queued"
        self._output.write(f"nbddp: attached to SLURM job {job_id}\n" if attached else
                           f"nbddp: submitted SLURM job {job_id}; after a kernel restart, "
                           f"nbddp.attach({job_id!r}) follows it again\n")
        self._mailbox = MailboxReader(self._run_dir.path, self.config.nprocs, self._events)
        self._launcher = SlurmLauncher(job_id, self._events.put)

    def _begin(self) -> None:
        threading.Thread(target=self._wait_launcher, daemon=True, name="nbddp-wait").start()
        # The caller's context goes along, so a notebook routes the output to the cell
        # that launched the run even while other cells execute (ipykernel >= 7).
        threading.Thread(target=contextvars.copy_context().run, args=(self._supervise,),
                         daemon=True, name="nbddp-supervisor").start()

    # --- public ---------------------------------------------------------------------

    def done(self) -> bool:
        """True once the run has ended and everything it started is gone."""
        return self._finished.is_set()

    def cancel(self) -> bool:
        """Stop every rank and wait until they are gone; False if the run had already ended."""
        if self._finished.is_set():
            return False
        self._cancel_reason = self._cancel_reason or "cancelled"
        self._events.put(_Wake())
        self._finished.wait()
        return True

    def result(self, timeout: float | None = None) -> R:
        """Rank 0's return value (every rank's with ``all_ranks``), or the run's error.

        ``timeout`` bounds this wait only. Interrupting the wait (Ctrl-C, the
        notebook's stop button) stops the run and re-raises ``KeyboardInterrupt``.
        """
        __tracebackhide__ = True  # IPython shows the user's call, not nbddp's frames
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._finished.wait(0.1):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the run is still going after {timeout} s")
        except KeyboardInterrupt:
            self._cancel_reason = "interrupted"
            self.cancel()
            raise
        assert self._outcome is not None
        ok, value = self._outcome
        if ok:
            return value
        raise value

    @property
    def logs(self) -> dict[int, str]:
        """Every rank's output so far, by rank, read from the run's records folder."""
        return self._run_dir.read_logs(self.config.nprocs)

    @property
    def records(self) -> Path:
        """The folder that keeps this run's full per-rank logs and metrics history."""
        return self._run_dir.records

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every step's rank-averaged metrics so far: dicts with ``step``, ``ranks`` and
        each metric (read from the run's records, so complete however long the run)."""
        return read_history(self._run_dir.metrics)

    # --- supervision ----------------------------------------------------------------

    def _make_tails(self, sink: BoundedOutput) -> list[LogTail]:
        if self.config.output == "rank0":
            return [LogTail(self._run_dir.rank_log(0), sink)]
        if self.config.output == "all":
            return [LogTail(self._run_dir.rank_log(r), sink, prefix=f"[rank {r}] ")
                    for r in range(self.config.nprocs)]
        return []

    def _wait_launcher(self) -> None:
        self._events.put(_LauncherExited(self._launcher.wait()))

    def _next_event(self, timeout: float | None) -> Any:
        """The next event, or None (nothing came, or a copy of what already came)."""
        try:
            event = self._events.get(timeout=timeout) if timeout else self._events.get_nowait()
        except queue.Empty:
            return None
        if isinstance(event, Sequenced):
            if event.seq < self._next_seq.get(event.rank, 0):
                return None  # it came through the rank's other link first
            self._next_seq[event.rank] = event.seq + 1
            return event.message
        if isinstance(event, Disconnected) and self._mailbox is not None:
            return None  # the rank's mailbox still speaks for it
        return event

    def _supervise(self) -> None:
        try:
            try:
                outcome = self._watch()
            except BaseException as exc:  # a bug here must not leave the run going
                logger.exception("nbddp supervisor failed")
                outcome = (False, NbddpError(f"nbddp supervisor failed: {exc!r}"))
            self._outcome = self._teardown(outcome)
        finally:
            self._finished.set()

    def _watch(self) -> tuple[bool, Any]:
        """Consume events until the run's ending is known; return (ok, value or error)."""
        deadline = None if self.config.timeout is None else self._started + self.config.timeout
        refreshed = 0.0
        while True:
            event = self._next_event(_PUMP_INTERVAL)
            for tail in self._tails:
                tail.pump()
            if self._cancel_reason:
                return False, (KeyboardInterrupt() if self._cancel_reason == "interrupted"
                               else CancelledError("the run was cancelled; every rank was stopped"))
            if deadline is not None and time.monotonic() > deadline:
                return False, TimeoutError(f"the run did not finish within {self.config.timeout} "
                                           "s; every rank was stopped")
            ending = self._handle(event)
            if ending is not None:
                return ending
            if time.monotonic() - refreshed >= _REFRESH_INTERVAL:  # coalesce redraws
                self._history.tick()
                self._panel.refresh(self.state)
                refreshed = time.monotonic()

    def _record(self, event: Any) -> None:
        """Bookkeeping for a message, whatever the run's state."""
        if isinstance(event, Metrics):
            self._history.add(event.rank, event.records)
            if event.rank == 0 and event.position is not None:
                self.state.set_position(event.position)
        elif isinstance(event, Hello):
            self._launcher.add_rank(event.pid)
            self.state.ranks[event.rank] = "running"
        elif isinstance(event, Result):
            self._results[event.rank] = event
            self.state.ranks[event.rank] = "finished"
        elif isinstance(event, Failure):
            self._failures.append(event)
            self.state.ranks[event.rank] = "failed"
        elif isinstance(event, Disconnected) and self._vanished(event.rank):
            self._failures.append(event)  # died without a word: a root-cause candidate
            self.state.ranks[event.rank] = "failed"
        elif isinstance(event, JobStatus):
            self._job_status(event)

    def _job_status(self, status: JobStatus) -> None:
        """Show a SLURM job's state: queued (and why), then where it runs."""
        assert self.slurm_job_id is not None
        self._output.write(f"nbddp: {status.describe(self.slurm_job_id)}\n")
        if status.state == "PENDING":
            self.state.status, self.state.message = "queued", status.reason
        elif status.state == "RUNNING":
            self.state.status, self.state.message = "running", f"on {status.nodes}"

    def _handle(self, event: Any) -> tuple[bool, Any] | None:
        """Record ``event``; return the run's ending if this event decides it."""
        vanished = isinstance(event, Disconnected) and self._vanished(event.rank)
        self._record(event)
        if vanished or (isinstance(event, Failure) and peer_lost(event)):
            # A rank died, or one lost its peer (which may be the one that died):
            # let torchrun say how the ranks ended before everything is stopped.
            return self._await_death_report()
        if isinstance(event, Failure):
            return False, None  # the error is built after teardown, from every report
        if self._mailbox is not None and len(self._results) == self.config.nprocs:
            return self._launcher_ended(0)  # the batch job's end is not worth waiting for
        if isinstance(event, _LauncherExited):
            return self._launcher_ended(event.code)
        return None

    def _vanished(self, rank: int) -> bool:
        """True if ``rank`` disconnected without returning or reporting an exception."""
        reported = any(getattr(f, "rank", None) == rank for f in self._failures)
        return rank not in self._results and not reported

    def _await_death_report(self) -> tuple[bool, Any]:
        """A rank vanished: give torchrun a moment to say how it ended, then stop all."""
        deadline = time.monotonic() + _DEATH_REPORT_WAIT
        while time.monotonic() < deadline:
            event = self._next_event(_PUMP_INTERVAL)
            if event is None:
                continue
            if isinstance(event, _LauncherExited):
                break
            self._record(event)
        return False, None

    def _launcher_ended(self, code: int) -> tuple[bool, Any]:
        if self._mailbox is not None:
            self._mailbox.poll()  # what the ranks wrote just before the job ended
        self._drain_reports()
        if len(self._results) == self.config.nprocs:
            if code != 0:  # e.g. gloo aborting at exit after a clean run
                logger.debug("torchrun exited %s after every rank returned; ignored", code)
            try:
                return True, self._collect_results()
            except NbddpError as exc:
                return False, exc
        stopped = self._launcher.stopped_from_outside()
        if stopped and not self._failures:
            return False, NbddpError(f"{stopped} before every rank returned; the ranks' "
                                     f"output is in {self._run_dir.records}")
        return False, None

    def _drain_reports(self) -> None:
        while not self._events.empty():
            event = self._next_event(None)
            if event is not None:
                self._record(event)

    def _collect_results(self) -> Any:
        ranks = range(self.config.nprocs) if self.config.all_ranks else [0]
        try:
            values = [loads_value(self._results[r].value or b"") for r in ranks]
        except Exception as exc:
            raise NbddpError(f"the run finished, but its return value cannot be unpickled in "
                             f"the notebook: {type(exc).__name__}: {exc}") from exc
        return values if self.config.all_ranks else values[0]

    # --- ending ---------------------------------------------------------------------

    def _teardown(self, outcome: tuple[bool, Any]) -> tuple[bool, Any]:
        """Stop every process, keep the logs, explain a failure, remove the run dir."""
        try:
            if hasattr(self, "_launcher"):
                self._launcher.stop(clean=outcome[0])
            if self._mailbox is not None:
                self._mailbox.close()  # after a last read of what the ranks wrote
            self._drain_reports()
            for tail in getattr(self, "_tails", []):
                tail.close()
            if outcome == (False, None):  # only a failure needs the logs read now
                outcome = False, diagnose(self._failures, self._results, self._run_dir,
                                          self.config.nprocs, self.logs)
            return outcome
        finally:
            if hasattr(self, "_server"):
                self._server.close()
            self._run_dir.remove()
            if hasattr(self, "_panel"):
                self._show_ending(outcome)

    def _show_ending(self, outcome: tuple[bool, Any]) -> None:
        self._output.close()
        self._history.close()
        self.state.ended = time.monotonic()
        self.state.status, self.state.message = _describe(outcome)
        self.state.ranks = [s if s != "running" else "stopped" for s in self.state.ranks]
        self._panel.close(self.state)


def _describe(outcome: tuple[bool, Any]) -> tuple[str, str]:
    """The panel's status word and message for how the run ended."""
    ok, value = outcome
    if ok:
        return "finished", ""
    if value is None:
        return "failed", ""
    if isinstance(value, KeyboardInterrupt):
        return "interrupted", "every rank was stopped"
    if isinstance(value, CancelledError):
        return "cancelled", "every rank was stopped"
    if isinstance(value, TimeoutError):
        return "timed out", str(value)
    return "failed", str(value).splitlines()[0] if str(value) else type(value).__name__
