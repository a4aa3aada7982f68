"""Following one run's messages: what the panel shows, and when and how the run ends.

The supervisor reads the group's events in order, forwards rank 0's output, feeds the
metrics history and the panel, and decides the ending: every rank returned, a rank
raised or died (the first one is the root cause), the launcher ended early, a timeout,
or a cancel. It does not stop anything itself; the ``Job`` does that with the ending.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any, Literal, TextIO

from .._errors import NbddpError
from .._panel.display import Panel, PanelState, WidgetPanel, make_panel
from .._panel.output import BoundedOutput, LogTail
from .._wire.history import History
from .._wire.messages import (
    Assigned,
    DebugDone,
    DebugPrompt,
    Disconnected,
    Failure,
    Hello,
    Metrics,
    RankStats,
    Requeueing,
    Result,
    Sequenced,
    StopRequested,
)
from .._wire.stacks import where
from .config import RunConfig
from .debugger import Debugger
from .diagnosis import describe, first_cause, peer_lost
from .group import LauncherExited, RankGroup
from .rank_view import RankView
from .records import Records

_PUMP_INTERVAL = 0.05
_REFRESH_INTERVAL = 0.1  # the panel redraws at most ten times a second
_DEATH_REPORT_WAIT = 2.0  # how long torchrun may take to report a rank that died
_RESTART_GATHER = 1.0  # how long a failed attempt's other reports may take to come in


@dataclass(frozen=True)
class Wake:
    """Put on the events so the supervisor notices a cancel at once."""


@dataclass(frozen=True)
class Ending:
    """What decided a run's end: every rank ``returned``, a rank ``failed`` (the error
    is built from every report once the group is stopped), or the kernel ``stopped``
    it (``error`` says why: interrupt, cancel, timeout...)."""

    kind: Literal["returned", "failed", "stopped"]
    error: BaseException | None = None


class Supervisor:
    """One run's bookkeeping: results, failures, metrics, output, panel."""

    def __init__(self, group: RankGroup, config: RunConfig, records: Records,
                 stdout: TextIO) -> None:
        self.group, self.config, self.records = group, config, records
        self.results: dict[int, Result] = {}
        self.failures: list[Failure | Disconnected] = []
        self.assigned: tuple[str, ...] | None = None
        """A session's names after this run (rank 0's ``Assigned``)."""
        self.launcher_exited = False
        self._next_seq: dict[tuple[int, int, int], int] = {}
        """Per rank, requeue and attempt: the next message number expected."""
        self.attempt = 0
        """torchrun's restarts so far in this run (each restarts every rank)."""
        self.causes: list[Failure | Disconnected] = []
        """Why each restart happened: the first cause of each failed attempt."""
        self.requeue = group.requeues_seen
        """SLURM's requeues of the job so far (each runs it again, restarts from 0)."""
        self.requeueing: set[int] = set()
        """Ranks that ended this run of the job with ``nbddp.requeue()``."""
        self.view = RankView(config.nprocs)
        """Each rank's state, step, speed and memory, live and after the run."""
        self._stalled = False
        self._stop_said = False
        self.debugger = Debugger(group.send_to_rank, self._note_now)
        """pdb on the ranks: their prompts, for the thread waiting in ``Job.result()``."""
        self.history = History(config.nprocs, records.metrics)
        self.state = PanelState(config.nprocs, self.history, str(records.path),
                                where=group.where)
        if group.slurm_job_id:
            self.state.status = "queued"
        self.panel: Panel = make_panel(stdout)
        self.output = BoundedOutput(self.panel.write, records.path)
        self._tails = self._make_tails()
        self.handlers: dict[type, Callable[[Any], None]] = group.event_handlers(self)
        """A backend's own events (a SLURM job's status) and what each does here."""
        if group.notice:
            self.output.write(group.notice + "\n")

    def _make_tails(self) -> list[LogTail]:
        in_place = isinstance(self.panel, WidgetPanel)  # progress bars update under the cell
        if self.config.output == "rank0":
            return [LogTail(self.records.rank_log(0), self.output, in_place=in_place)]
        if self.config.output == "all":
            return [LogTail(self.records.rank_log(r), self.output, prefix=f"[rank {r}] ",
                            in_place=in_place) for r in range(self.config.nprocs)]
        return []

    # --- events -----------------------------------------------------------------------

    def _next_event(self, timeout: float | None) -> Any:
        """The next event, or None (nothing came, or a copy of what already came)."""
        try:
            event = (self.group.events.get(timeout=timeout) if timeout
                     else self.group.events.get_nowait())
        except queue.Empty:
            return None
        if isinstance(event, (Sequenced, Disconnected)):
            if event.requeue > self.requeue:
                self.requeued(event.requeue)  # the ranks of the job's next run speak first
            if (event.requeue, event.attempt) < (self.requeue, self.attempt):
                return None  # from an attempt that failed or a run SLURM requeued
        if isinstance(event, Sequenced):
            key = (event.rank, event.requeue, event.attempt)
            if event.seq < self._next_seq.get(key, 0):
                return None  # it came through the rank's other link first
            self._next_seq[key] = event.seq + 1
            return event.message
        return event

    def watch(self, deadline: float | None, cancelled: Callable[[], str | None]) -> Ending:
        """Consume events until the run's ending is known."""
        refreshed = 0.0
        while True:
            event = self._next_event(_PUMP_INTERVAL)
            self.pump_output()
            reason = cancelled()
            if reason == "interrupted":
                return Ending("stopped", self._with_stacks(KeyboardInterrupt, ""))
            if reason:
                return Ending("stopped", CancelledError("the run was cancelled; every rank "
                                                        "was stopped"))
            if deadline is not None and time.monotonic() > deadline:
                return Ending("stopped", self._with_stacks(
                    TimeoutError, f"the run did not finish within {self.config.timeout} s; "
                                  "every rank was stopped"))
            ending = self._handle(event)
            if ending is not None:
                return ending
            if time.monotonic() - refreshed >= _REFRESH_INTERVAL:  # coalesce redraws
                self.history.tick()
                self._update_view()
                self.panel.refresh(self.state)
                refreshed = time.monotonic()

    def _with_stacks(self, kind: type[BaseException], message: str) -> BaseException:
        """``kind(message)``, with where each rank still running was (``.stacks``, also
        kept in the records), taken before anything stops them."""
        running = set(range(self.config.nprocs)) - self.reported
        stacks = {rank: text for rank, text in self.group.stacks().items() if rank in running}
        if stacks:
            self.records.stacks.write_text(
                "".join(f"--- rank {rank} ---\n{text}\n\n" for rank, text in stacks.items()))
            message += ("\n" if message else "") + where(stacks)
        error = kind(message) if message else kind()
        error.stacks = stacks  # type: ignore[attr-defined]
        return error

    def pump_output(self) -> None:
        for tail in self._tails:
            tail.pump()

    def _record(self, event: Any) -> None:
        """Bookkeeping for a message, whatever the run's state."""
        if isinstance(event, RankStats):
            self.view.add(event)
        elif isinstance(event, DebugPrompt):
            self.state.ranks[event.rank] = "debugging"
            self.view.touch()
            self.debugger.prompt(event)
        elif isinstance(event, DebugDone):
            self.state.ranks[event.rank] = "running"
            self.view.touch()
            self.debugger.done(event.rank)
        elif isinstance(event, Metrics):
            self.history.add(event.rank, event.records)
            self.history.add(event.rank, event.for_all, for_all=True)
            if event.rank == 0 and event.position is not None:
                self.state.set_position(event.position)
        elif isinstance(event, Hello):
            self.state.ranks[event.rank] = "running"
            self.view.touch()
        elif isinstance(event, Result):
            self.results[event.rank] = event
            self.state.ranks[event.rank] = "finished"
            self.debugger.done(event.rank)  # its pdb, if any, is over (it may have stepped off)
        elif isinstance(event, Failure):
            self.failures.append(event)
            self.state.ranks[event.rank] = "failed"
            self.debugger.done(event.rank)
        elif isinstance(event, Disconnected) and self._vanished(event.rank):
            self.failures.append(event)  # died without a word: a root-cause candidate
            self.state.ranks[event.rank] = "failed"
        elif isinstance(event, Requeueing):
            self.requeueing.add(event.rank)
            self.state.ranks[event.rank] = "requeueing"
            self.state.message = "the ranks called nbddp.requeue(): the job goes back to the queue"
        elif isinstance(event, StopRequested):
            self._stop_requested()
        elif isinstance(event, Assigned):
            self.assigned = event.names
        elif isinstance(event, LauncherExited):
            self.launcher_exited = True
        elif type(event) in self.handlers:
            self.handlers[type(event)](event)

    def _update_view(self) -> None:
        """The panel's per-rank notes and stragglers; say when the run looks stalled."""
        ranks = self.view.ranks(self.state.ranks)
        self.state.rank_notes = {r: self.view.summary(info) for r, info in ranks.items()}
        self.state.behind = {r for r, info in ranks.items() if info["behind"]}
        limit, quiet = self.config.stall_after, self.view.quiet_for()
        if limit is None or self.state.status != "running" or "debugging" in self.state.ranks:
            return
        if quiet >= limit and not self._stalled:
            self._stalled = True
            self.state.message = (f"looks stalled: no rank has printed or advanced for "
                                  f"{int(quiet)} s; an interrupt (or job.stacks()) shows "
                                  "where each rank is")
            self._note_now(f"nbddp: the run {self.state.message}\n")
        elif quiet < limit and self._stalled:
            self._stalled = False
            self.state.message = ""

    def _note_now(self, line: str) -> None:
        """A line of nbddp's own, after the ranks' output so far."""
        self.pump_output()
        self.output.write(line)

    def _new_attempt(self, message: str, line: str) -> None:
        """The ranks start again (a torchrun restart, a SLURM requeue): what the last
        attempt said is over; say why, and follow the next one."""
        self.view.restart()
        self.results.clear()
        self.failures.clear()
        self.requeueing.clear()
        self.state.ranks = ["starting"] * self.config.nprocs
        self.state.message = message
        self._note_now(line)
        self.panel.refresh(self.state)

    def requeued(self, requeue: int) -> None:
        """SLURM put the job back in the queue: the notebook follows its next run (which
        starts the function again)."""
        self.requeue, self.attempt = requeue, 0
        self.state.status = "requeued"
        self._new_attempt(f"requeue {requeue}",
                          f"nbddp: SLURM job {self.group.slurm_job_id} was requeued "
                          f"(requeue {requeue}); following its next run\n")

    def _stop_requested(self) -> None:
        """SLURM's warning before the time limit reached the ranks (said once)."""
        if self._stop_said:
            return
        self._stop_said = True
        self.state.message = "time limit near: nbddp.stop_requested() is true on the ranks"
        self._note_now(f"nbddp: SLURM job {self.group.slurm_job_id} nears its time limit; "
                       "nbddp.stop_requested() is now true on the ranks\n")

    def _requeue_underway(self) -> bool:
        """A rank failed: true if SLURM is requeueing the job, which stops its ranks
        (then the failure is not the run's end); follows the next run if so."""
        requeues = self.group.requeues()
        if requeues > self.requeue:
            self.requeued(requeues)
            return True
        return False

    def _handle(self, event: Any) -> Ending | None:
        """Record ``event``; the run's ending if this event decides it."""
        vanished = isinstance(event, Disconnected) and self._vanished(event.rank)
        self._record(event)
        failed = vanished or isinstance(event, Failure)
        if failed and self._requeue_underway():
            return None
        if failed and self.attempt < self.config.max_restarts:
            return self._restarting()
        if vanished or (isinstance(event, Failure) and peer_lost(event)):
            # A rank died, or one lost its peer (which may be the one that died):
            # let torchrun say how the ranks ended before everything is stopped.
            self._await_death_report()
            return Ending("failed")
        if isinstance(event, Failure):
            return Ending("failed")
        if len(self.results) == self.config.nprocs:
            return Ending("returned")  # the launcher's own end is not worth waiting for
        if isinstance(event, LauncherExited):
            return self._launcher_ended()
        return None

    def _restarting(self) -> Ending | None:
        """A rank failed with restarts left: torchrun stops every rank and starts them
        again. Gather this attempt's other reports, say why, and follow the next one
        (unless torchrun ended instead: then the run has ended)."""
        deadline = time.monotonic() + _RESTART_GATHER
        while time.monotonic() < deadline and not self.launcher_exited:
            event = self._next_event(_PUMP_INTERVAL)
            if event is not None:
                self._record(event)
        if self.launcher_exited:
            return self._launcher_ended()
        cause = first_cause(self.failures)
        self.causes.append(cause)
        self._keep_tracebacks()
        self.attempt += 1
        message = f"restart {self.attempt} of {self.config.max_restarts}: {describe(cause)}"
        self._new_attempt(message, f"nbddp: {message}\n")
        return None

    def _keep_tracebacks(self) -> None:
        """Append what each rank of the failed attempt raised to its log, where the next
        attempt's output follows: every attempt's story stays in the records."""
        for failure in self.failures:
            if isinstance(failure, Failure) and failure.traceback:
                with open(self.records.rank_log(failure.rank), "a") as log:
                    log.write(f"nbddp: attempt {self.attempt + 1} of rank {failure.rank} "
                              f"failed:\n{failure.traceback.rstrip()}\n")

    def _vanished(self, rank: int) -> bool:
        """True if ``rank`` disconnected without returning or reporting an exception."""
        reported = any(getattr(f, "rank", None) == rank for f in self.failures)
        return rank not in self.results and not reported

    def _await_death_report(self) -> None:
        """A rank vanished: give torchrun a moment to say how it ended."""
        deadline = time.monotonic() + _DEATH_REPORT_WAIT
        while time.monotonic() < deadline:
            event = self._next_event(_PUMP_INTERVAL)
            if isinstance(event, LauncherExited):
                return
            if event is not None:
                self._record(event)

    def _launcher_ended(self) -> Ending:
        """torchrun or the batch job ended before every rank returned."""
        self.group.sync()  # what the ranks wrote just before it ended
        self.drain()
        if len(self.results) == self.config.nprocs:
            return Ending("returned")  # e.g. gloo aborting at exit after a clean run
        if self.requeueing and not self.failures:
            return Ending("stopped", NbddpError(
                f"the ranks called nbddp.requeue(), but {self.group.where} ended instead of "
                f"going back to the queue; see {self.records.launcher_log}"))
        stopped = self.group.stopped_from_outside()
        if stopped and not self.failures:
            return Ending("stopped", NbddpError(
                f"{stopped} before every rank returned; the ranks' output is in "
                f"{self.records.path}"))
        return Ending("failed")

    @property
    def reported(self) -> set[int]:
        """Ranks that returned or raised in this run (and so are done with it)."""
        return (set(self.results) | self.requeueing
                | {f.rank for f in self.failures if isinstance(f, Failure)})

    @property
    def lost(self) -> bool:
        """A rank died, or the launcher ended: the group cannot run again."""
        return self.launcher_exited or any(isinstance(f, Disconnected) for f in self.failures)

    def wait_reports(self, seconds: float) -> bool:
        """Follow events until every rank has reported (True), or ``seconds`` passed or
        the group was lost (False)."""
        deadline = time.monotonic() + seconds
        everyone = set(range(self.config.nprocs))
        while self.reported != everyone and not self.lost and time.monotonic() < deadline:
            event = self._next_event(_PUMP_INTERVAL)
            self.pump_output()
            if event is not None:
                self._record(event)
        if self.reported == everyone and self.assigned is None and not self.lost:
            self._await_assigned(deadline)
        return self.reported == everyone and not self.lost

    def _await_assigned(self, deadline: float) -> None:
        """Rank 0 sends a session's names right after its report."""
        while self.assigned is None and time.monotonic() < deadline:
            event = self._next_event(_PUMP_INTERVAL)
            if event is not None:
                self._record(event)

    def drain(self) -> None:
        """Record every event already queued."""
        while not self.group.events.empty():
            event = self._next_event(None)
            if event is not None:
                self._record(event)

    def close_output(self) -> None:
        """Show the last of the ranks' output; average what is left of the history."""
        for tail in self._tails:
            tail.close()
        self.output.close()
        self.history.close()

    def note(self, line: str) -> None:
        """Set the panel's last line (it may already be closed)."""
        self.state.footer = line
        self.panel.note(self.state)

    def wake(self) -> None:
        self.group.events.put(Wake())

