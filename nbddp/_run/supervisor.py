"""Following one run's messages: what the panel shows, and when and how the run ends.

The supervisor registers a handler for each kind of rank message with the run's
``Pump`` (the backend and a session add theirs), forwards rank 0's output, feeds the
metrics history and the panel, and decides the ending after each event: every rank
returned, a rank raised or died (the first one is the root cause; with restarts left,
torchrun starts every rank again instead), the launcher ended early, a timeout, or a
cancel. It does not stop anything itself; the ``Job`` does that with the ending.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any, Literal, TextIO

from .._errors import NbddpError
from .._panel.frontend import make_panel
from .._panel.many_ranks import MANY_RANKS, notable
from .._panel.output import BoundedOutput, LogTail
from .._panel.state import Panel, PanelState
from .._panel.widget_panel import WidgetPanel
from .._wire.history import History
from .._wire.messages import (
    DebugDone,
    DebugPrompt,
    Disconnected,
    Failure,
    Hello,
    Metrics,
    Requeueing,
    Result,
)
from .._wire.rank_stats import RankStats, StepTimes
from .._wire.relay_messages import NodeMetrics, RanksFinished
from .attempts import Attempt
from .config import RunConfig
from .debugger import Debugger
from .diagnosis import describe, first_cause, peer_lost, secondary
from .group import GroupHooks, LauncherExited, RankGroup
from .hang_report import look_at
from .pump import Numbered, Pump
from .rank_view import RankView
from .records import Records
from .stack_view import summary_of, where
from .time_split import TimeSplit, split_lines

_REFRESH_INTERVAL = 0.1  # the panel redraws at most ten times a second
_OUTPUT_INTERVAL = 0.05  # the ranks' logs are read at most twenty times a second
_DEATH_REPORT_WAIT = 2.0  # how long torchrun may take to report a rank that died
_RESTART_GATHER = 1.0  # how long a failed attempt's other reports may take to come in
_LINKS_END_WAIT = 2.0  # how long the ranks' links' ends may come after torchrun's


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
    """One run's bookkeeping: its attempts, metrics, output, panel, and its ending."""

    def __init__(self, group: RankGroup, config: RunConfig, records: Records,
                 stdout: TextIO, where: str, warm: bool = False,
                 quiet_when_quick: bool = False) -> None:
        """``warm``: ranks already up took the run (they said hello before it: a
        session's, once, as it started), so they run it from the start.
        ``quiet_when_quick``: see ``PanelState``."""
        self.group, self.config, self.records = group, config, records
        self.attempt = Attempt(config.nprocs)
        """The ranks' current start: what each reported (each rank's state)."""
        self.causes: list[Failure | Disconnected] = []
        """Why each restart happened: the first cause of each failed attempt."""
        self._attempts_seen: set[tuple[int, int]] = {self.attempt.key}
        """The (requeue, restart) of every attempt that a rank's message came from."""
        self.launcher_exited = False
        self.ended = False
        """The run is over: ranks that were still running were stopped."""
        self.view = RankView(config.nprocs)
        """Each rank's step, speed and memory, live and after the run."""
        self.split = TimeSplit()
        """Where each rank's step time goes (data, compute, collectives)."""
        self._stalled = False
        self._stalled_at: dict[int, str] = {}  # where each rank was when it stalled
        self._notes_due = False  # (see ``_final_notes``)
        # The clocks start now: a quick run's first look is its last, in ``close``.
        self._refreshed = self._pumped = time.monotonic()
        self._ending: Ending | None = None
        self._answering = config.rank_options.answering  # whose progress the bar shows
        self._resting = config.resting_ranks  # a session's ranks the run is not given to
        self.history = History(len(config.running_ranks), records.metrics)  # (who logs)
        self.state = PanelState(config.nprocs, self.history, str(records.path),
                                where=where, quiet_when_quick=quiet_when_quick)
        self.panel: Panel = make_panel(stdout, quiet=config.output == "none")
        self.output = BoundedOutput(self.panel.write, records.path)
        self._tails = self._make_tails()
        self._note_now = _noting(self._tails, self.output)  # (refers to no supervisor)
        self.debugger = Debugger(group.send_to_rank, self._note_now)
        """pdb on the ranks: their prompts, for the thread waiting in ``Job.result()``."""
        self.pump = Pump(group.events, lambda: self.attempt.key, group.release_held)
        self._register()
        self.hooks = group.hooks(self)
        """The backend's part: its own events, its ranks' next run, why it ended."""
        if warm:
            self.attempt.started.update(config.running_ranks)
        if group.notice:
            self.output.write(group.notice + "\n")

    def _make_tails(self) -> list[LogTail]:
        in_place = isinstance(self.panel, WidgetPanel)  # progress bars update under the cell
        running = self.config.running_ranks  # (rank 0, unless a session's run is not on it)
        if self.config.output == "rank0":
            return [self._tail(running[0], "", in_place)]
        if self.config.output == "all":
            return [self._tail(r, f"[rank {r}] ", in_place) for r in running]
        return []

    def _tail(self, rank: int, prefix: str, in_place: bool) -> LogTail:
        """``rank``'s output in this run, shown as it comes."""
        records = self.records
        return LogTail(records.rank_log(rank), self.output, prefix=prefix, in_place=in_place,
                       start=records.log_start(rank), end=lambda: records.log_end(rank),
                       shown=functools.partial(records.shown, rank))

    # --- a handler per message ----------------------------------------------------------

    def _register(self) -> None:
        on = self.pump.on
        on(RankStats, self.view.add)
        on(StepTimes, self.split.add)
        on(Hello, self._hello)
        on(DebugPrompt, self._debug_prompt)
        on(DebugDone, self._debug_done)
        on(Metrics, self._metrics)
        on(Result, self._result)
        on(RanksFinished, self._finished)
        on(NodeMetrics, self._node_metrics)
        on(Failure, self._failure)
        on(Disconnected, self._disconnected)
        on(Requeueing, lambda report: self.attempt.requeueing.add(report.rank))
        on(LauncherExited, self._launcher_exit)
        self.pump.on_arrival(self._arrived)

    def _hello(self, hello: Hello) -> None:
        self.attempt.started.add(hello.rank)
        self.view.touch()

    def _debug_prompt(self, prompt: DebugPrompt) -> None:
        self.attempt.debugging.add(prompt.rank)
        self.view.touch()
        self.pump_output()  # what the line stepped over printed comes before the prompt
        self.debugger.prompt(prompt)

    def _debug_done(self, done: DebugDone) -> None:
        self.attempt.debugging.discard(done.rank)
        self.attempt.started.add(done.rank)
        self.view.touch()
        self.debugger.done(done.rank)

    def _metrics(self, metrics: Metrics) -> None:
        self.history.add(metrics.rank, metrics.records)
        self.history.add(metrics.rank, metrics.for_all, for_all=True)
        if metrics.rank == self._answering and metrics.position is not None:
            self.state.set_position(metrics.position)

    def _node_metrics(self, metrics: NodeMetrics) -> None:
        """A node's metrics, reduced by its relay (``_metrics`` for many ranks)."""
        self.history.add_reduced(metrics.partials)
        for rank, records in metrics.for_all:
            self.history.add(rank, records, for_all=True)
        position = metrics.positions.get(self._answering)
        if position is not None:
            self.state.set_position(position)

    def _final_stats(self, stats: RankStats | None) -> None:
        """A rank's stats as its run ended, with its report: its view, and where its
        log reached (``Records.reached``)."""
        if stats is not None:
            self.view.add(stats)
            self.records.reached(stats.rank, stats.output_bytes)

    def _result(self, result: Result) -> None:
        self._final_stats(result.stats)
        self.attempt.results[result.rank] = result
        self.debugger.done(result.rank)  # its pdb, if any, is over (it may have stepped off)

    def _finished(self, finished: RanksFinished) -> None:
        """A node's ranks finished with nothing to send back: each one's ``Result``, in
        bulk (a node's relay says this for its ranks at once)."""
        self.view.add_final(finished.stats)
        for rank, size in zip(finished.stats.rank, finished.stats.output_bytes, strict=True):
            self.records.reached(rank, size)
        self.attempt.finished_quietly(finished.ranks)
        self.debugger.done_all(finished.ranks)

    def _failure(self, failure: Failure) -> None:
        self._final_stats(failure.stats)
        self._note_stopped(failure)
        self.attempt.failures.append(failure)
        self.debugger.done(failure.rank)

    def _disconnected(self, event: Disconnected) -> None:
        if self.attempt.vanished(event.rank):
            self._note_stopped(event)
            self.attempt.failures.append(event)  # died without a word: a root-cause candidate

    def _note_stopped(self, report: Failure | Disconnected) -> None:
        """A rank that died, or raised only because a peer went or nbddp interrupted it,
        after the run's end was decided, was stopped; one that raised an error of its own
        then (the same bad batch on every rank) failed, as after a stop (a timeout, an
        interrupt) any report is the stop's."""
        if self._ending is not None and (self._ending.kind == "stopped" or isinstance(
                report, Disconnected) or secondary(report)):
            self.attempt.stopped.add(report.rank)

    def _launcher_exit(self, event: LauncherExited) -> None:
        self.launcher_exited = True

    def _arrived(self, message: Numbered) -> None:
        """Note which attempt sent ``message`` (held or stale ones too): proof that
        torchrun started that attempt, even if the run is no longer followed there."""
        self._attempts_seen.add((message.requeue, message.attempt))

    # --- the run's course -----------------------------------------------------------------

    def watch(self, deadline: float | None, cancelled: Callable[[], str | None],
              seconds: float | None = None, pause: Callable[[], bool] = lambda: False
              ) -> Ending | None:
        """Follow the run until its ending is known; None if ``seconds`` passed first, or
        ``pause()`` turned true (the run is then followed on by a next ``watch``)."""
        self.pump.run(lambda: self._ending is not None or pause(), seconds,
                      gate=lambda: self._going_on(deadline, cancelled),
                      then=self._decide, turn=self._refresh_now_and_then)
        return self._ending

    def _going_on(self, deadline: float | None, cancelled: Callable[[], str | None]) -> bool:
        """False once the run was interrupted, cancelled or timed out (its ending set)."""
        reason = cancelled()
        if reason == "interrupted":
            self._ending = Ending("stopped", self._with_stacks(KeyboardInterrupt, ""))
        elif reason:
            self._ending = Ending("stopped", CancelledError(
                "the run was cancelled; every rank was stopped"))
        elif deadline is not None and time.monotonic() > deadline:
            self._ending = Ending("stopped", self._with_stacks(
                TimeoutError, f"the run did not finish within {self.config.timeout:g} s; "
                              "every rank was stopped"))
        return self._ending is None

    def _decide(self, event: Any) -> None:
        """After each event while the run goes on: the run's ending, if it decides it."""
        if self.attempt.failed_with(event):
            self._ending = self._failed(event)
        elif self.attempt.returned:
            self._ending = Ending("returned")  # the launcher's own end is not worth waiting for
        elif isinstance(event, LauncherExited):
            self._ending = self._launcher_ended()

    def _failed(self, event: Failure | Disconnected) -> Ending | None:
        """A rank raised or died: the run's end, unless the ranks start again."""
        if self.hooks.moved_on():
            return None  # the backend follows its ranks' next run (a SLURM requeue)
        if self.attempt.number < self.config.max_restarts:
            return self._restarting()
        if isinstance(event, Disconnected) or peer_lost(event):
            # A rank died, or one lost its peer (which may be the one that died):
            # let torchrun say how the ranks ended before everything is stopped.
            self.pump.run(lambda: self.launcher_exited, _DEATH_REPORT_WAIT)
            return self._stopped_from_outside() or Ending("failed")
        return Ending("failed")

    def _restarting(self) -> Ending | None:
        """A rank failed with restarts left: torchrun stops every rank and starts them
        again. Gather this attempt's other reports (the rank that raised may be heard of
        after a peer whose collective broke), say why, and follow the next one. If
        torchrun ended meanwhile, the run has ended, maybe in a later attempt: its
        attempts can be quicker than this wait (see ``_launcher_ended``)."""
        self.pump.run(lambda: self.launcher_exited, _RESTART_GATHER)
        if self.launcher_exited:
            return self._launcher_ended()
        self._restart()
        return None

    def _restart(self) -> None:
        """Say why this attempt failed (its root cause), keep its tracebacks, and follow
        the next one."""
        cause = first_cause(self.attempt.failures)
        self.causes.append(cause)
        self.attempt.keep_tracebacks(self.records)
        number = self.attempt.number + 1
        message = f"restart {number} of {self.config.max_restarts}: {describe(cause)}"
        self.new_attempt(self.attempt.requeue, number, message, f"nbddp: {message}\n")

    def _follow_restarts(self) -> None:
        """torchrun ended: follow each attempt it started after the one followed, whose
        messages wait in the pump, so that the run's error is its last attempt's and
        every restart is counted."""
        while (self.attempt.failures and self.attempt.number < self.config.max_restarts
               and (self.attempt.requeue, self.attempt.number + 1) in self._attempts_seen):
            self._restart()
            self.pump.drain()  # (the next attempt's messages, held until now)

    def new_attempt(self, requeue: int, number: int, message: str, line: str) -> None:
        """The ranks start again (a torchrun restart, a SLURM requeue): what the last
        attempt said is over; say why, and follow the next one."""
        self.attempt = Attempt(self.config.nprocs, requeue, number)
        self.view.restart()
        self.split.restart()
        self.state.message = message
        self.note_now(line)
        self.state.ranks = self.rank_states()
        self.panel.refresh(self.state)

    def _launcher_ended(self) -> Ending:
        """torchrun or the batch job ended before every rank returned (as far as the
        kernel has heard: where it hears its ranks' links close, it waits up to
        ``_LINKS_END_WAIT`` for every rank that said hello to be heard of first)."""
        self.group.sync()  # what the ranks wrote just before it ended
        self.pump.drain()
        self._follow_restarts()
        if not self.attempt.returned and self.group.hears_link_ends:
            self.pump.run(self._every_started_rank_heard_of, _LINKS_END_WAIT)
            self._follow_restarts()
        if self.attempt.returned:
            return Ending("returned")  # e.g. gloo aborting at exit after a clean run
        error = self.hooks.ended_early()
        if error is not None:
            return Ending("stopped", error)
        return self._stopped_from_outside() or Ending("failed")

    def _every_started_rank_heard_of(self) -> bool:
        """Every rank that said hello has reported its end, or its link has closed. (When
        torchrun ends, its ranks end with it, and a node's relay in it: the kernel may
        hear that it ended before their links' ends and last reports, which say how the
        ranks ended, or that they all returned.)"""
        attempt = self.attempt
        return attempt.started <= attempt.reported | {f.rank for f in attempt.failures}

    def _stopped_from_outside(self) -> Ending | None:
        """The run's end if someone else stopped the ranks (SLURM's time limit, a
        cancel, a lost node) and none failed of its own accord first: that is the cause
        to name, not the ranks it killed."""
        if not all(isinstance(f, Disconnected) or peer_lost(f) for f in self.attempt.failures):
            return None
        stopped = self.group.stopped_from_outside()
        if stopped is None:
            return None
        return Ending("stopped", NbddpError(
            f"{stopped} before every rank returned; the ranks' output is in "
            f"{self.records.path}"))

    @property
    def running(self) -> set[int]:
        """The ranks that have not reported an end of this attempt (all, while it runs)."""
        return set(range(self.config.nprocs)) - self.attempt.reported

    @property
    def starting(self) -> set[int]:
        """The ranks of this attempt that have not said hello yet."""
        return set(range(self.config.nprocs)) - self.attempt.started

    def _with_stacks(self, kind: type[BaseException], message: str) -> BaseException:
        """``kind(message)``, with where each rank still running was (``.stacks``) and
        where each is in its collectives (``.hang_report``), taken before anything stops
        them; both also kept in the records."""
        running = self.running
        stacks, report = self._look_at(running) if running else ({}, "")
        if stacks or report:
            self.records.stacks.write_text(
                "".join(f"--- rank {rank} ---\n{text}\n\n" for rank, text in stacks.items())
                + report + "\n")
            message += ("\n" if message else "") + where(stacks, report)
        error = kind(message) if message else kind()
        error.stacks = stacks  # type: ignore[attr-defined]
        error.hang_report = report  # type: ignore[attr-defined]
        return error

    @property
    def lost(self) -> bool:
        """A rank died, or the launcher ended: the group cannot run again."""
        return self.launcher_exited or any(isinstance(f, Disconnected)
                                           for f in self.attempt.failures)

    # --- what the user sees ---------------------------------------------------------------

    def rank_states(self) -> list[str]:
        """Each rank's state now (see ``_run.attempts``); ``resting`` for a session's rank
        the run was not given to."""
        states = self.attempt.states(self.ended)
        for rank in self._resting:
            states[rank] = "resting"
        return states

    def _look_at(self, ranks: set[int]) -> tuple[dict[int, str], str]:
        """``ranks``' stacks and the hang report (``hang_report.look_at``); the report
        also names the ranks a collective in this run waits for in vain, if it was given
        to some ranks only."""
        stacks, report = look_at(self.group, ranks, self.starting)
        if self._resting and report:
            who = ", ".join(map(str, self._resting))
            given = ", ".join(map(str, self.config.running_ranks))
            report += (f"\nranks {who} are at rest: this run is on ranks {given} only, so a "
                       "collective in it waits for them forever")
        return stacks, report

    def _note_ranks(self) -> None:
        """Each rank's state, and its note (step, speed, memory, node) as of its last
        report: at the run's end, its final one. With many ranks, the notes of the few
        the panel names (``_panel.many_ranks``), unless the user asked for every rank."""
        states = self.state.ranks = self.rank_states()
        rates = self.view.rates()
        self.state.behind = {r for r in self.view.behind(rates) if states[r] == "running"}
        only = None
        if self.config.nprocs > MANY_RANKS:
            reported = [failure.rank for failure in self.attempt.failures]
            self.state.notable = notable(states, reported, self.state.behind, rates)
            only = {rank for _, rank in self.state.notable}
            view = self.view  # (the panel keeps this: no reference back to the supervisor)
            self.state.every_note = lambda: _notes(view, states, rates)
        self.state.rank_notes = _notes(self.view, states, rates, only)

    def _refresh_now_and_then(self) -> None:
        """Show the ranks' new output every ``_OUTPUT_INTERVAL`` and redraw the panel
        every ``_REFRESH_INTERVAL`` (redraws coalesce), not on every event: between the
        reports of a quick run's ranks, each look would be on the way to its end."""
        now = time.monotonic()
        if now - self._pumped >= _OUTPUT_INTERVAL:
            self.pump_output()
            self._pumped = now
        if now - self._refreshed >= _REFRESH_INTERVAL:
            self.history.tick()
            self._update_view()
            self.panel.refresh(self.state)
            self._refreshed = time.monotonic()

    def _update_view(self) -> None:
        """The panel's rank states, notes and stragglers; say when the run looks stalled."""
        self._note_ranks()
        self._update_split()
        limit, quiet = self.config.stall_after, self.view.quiet_for()
        if limit is None or self.state.status != "running" or "debugging" in self.state.ranks:
            return
        if quiet >= limit and not self._stalled:
            self._stalled = True
            self._say_stalled(quiet)
        elif quiet < limit and self._stalled:
            self._stalled = False
            self._stalled_at = {}
            self.state.message = ""
        self.state.rank_notes.update(self._stalled_at)

    def _update_split(self) -> None:
        splits = self.split.splits()
        self.state.split_bars = {r: (s.data, s.compute, s.collectives)
                                 for r, s in splits.items()}
        self.state.split_lines = split_lines(splits)

    def _say_stalled(self, quiet: float) -> None:
        """The run looks stalled: say so, where each rank is and who waits for whom (the
        panel names each rank's place until it moves again)."""
        stacks, report = self._look_at(self.running)
        lines = {rank: summary_of(text) for rank, text in stacks.items()}
        self._stalled_at = {rank: line.split(": ", 1)[-1] for rank, line in lines.items()}
        self.state.message = f"looks stalled: no rank has printed or advanced for {int(quiet)} s"
        where = "".join(f"{line}\n" for _, line in sorted(lines.items()))
        self.note_now(f"nbddp: the run {self.state.message}\n{where}{report}\n"
                      "nbddp: an interrupt stops it and shows each rank's stack "
                      "(job.stacks() and job.hang_report() while it goes on)\n")

    def pump_output(self) -> None:
        _pump(self._tails)

    def note_now(self, line: str) -> None:
        """A line of nbddp's own, after the ranks' output so far."""
        self._note_now(line)

    def release(self) -> None:
        """(The run is over, its end told) Drop what refers back to this supervisor: the
        pump's handlers and the backend's hooks. Its objects then go with its ``Job`` as
        soon as nothing refers to that, by reference counting. Left in cycles, a run's
        hundred objects made the garbage collector run every few cells (a no-op cell of
        a 2-rank session: 7% slower at the median, 14% on average)."""
        self.pump.close()
        self.hooks = GroupHooks(None)

    def close(self, status: str, message: str) -> None:
        """The run's last word: the last of the ranks' output, the rest of the history
        averaged, and the panel's final state (ranks still running were stopped)."""
        self.pump_output()
        for tail in self._tails:
            tail.close()
        self.output.close()
        self.history.close()
        self.ended = True
        self.state.ended = time.monotonic()
        self.state.status, self.state.message = status, message
        self._notes_due = True  # (the notes of the last refresh may be a second old)
        if self.panel.draws_ranks(self.state):
            self._final_notes()
        self._update_split()
        self.panel.close(self.state)

    def _final_notes(self) -> None:
        """The ranks' notes as the run ended, once: worked out when the panel draws the
        ranks, or when ``Job.state`` is asked (a quick cell's panel never shows them)."""
        if self._notes_due:
            self._notes_due = False
            self._note_ranks()
            self.state.rank_notes.update(self._stalled_at)  # (where a stalled run's ranks were)

    @property
    def shown_state(self) -> PanelState:
        """The panel's state, with the ranks' final notes once the run is over."""
        self._final_notes()
        return self.state

    def note(self, line: str) -> None:
        """Set the panel's last line (it may already be closed)."""
        self.state.footer = line
        self.panel.note(self.state)

    def wake(self) -> None:
        self.group.events.put(Wake())


def _noting(tails: list[LogTail], output: BoundedOutput) -> Callable[[str], None]:
    """``Supervisor.note_now``, made without a reference to the supervisor: its debugger
    keeps it, and may note a refused prompt after the run (see ``Supervisor.release``)."""
    def note(line: str) -> None:
        _pump(tails)
        output.write(line)
    return note


def _pump(tails: list[LogTail]) -> None:
    """Show what the ranks wrote since the last look."""
    for tail in tails:
        tail.pump()


def _notes(view: RankView, states: list[str], rates: dict[int, float | None],
           only: set[int] | None = None) -> dict[int, str]:
    """Each rank's note (``only`` those ranks')."""
    several_nodes = len(view.hosts) > 1
    return {r: view.summary(info, several_nodes)
            for r, info in view.ranks(states, only, rates).items()}
