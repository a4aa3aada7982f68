"""Following one run's messages: what each rank said, and the run's parts that use it.

The supervisor registers a handler for each kind of rank message with the run's
``Pump`` (the backend and a session add theirs) and reads each into the run's current
attempt, its metrics history, rank view and time split. The rest is done by the parts
it holds, each of one idea: ``RunCourse`` decides the run's ending after each event
(restarts, the launcher's end, timeouts, cancels), ``RunPanel`` keeps what the panel
shows, ``RunOutput`` shows the ranks' output, ``StallWatch`` says where the ranks are
when the run stalls or is stopped. It does not stop anything itself; the ``Job`` does
that with the ending.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from .._panel.frontend import make_panel
from .._panel.state import PanelState
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
from .diagnosis.debugger import Debugger
from .diagnosis.rank_view import RankView
from .diagnosis.root_cause import secondary
from .diagnosis.stall_watch import StallWatch
from .diagnosis.time_split import TimeSplit
from .groups.group import GroupHooks, LauncherExited, RankGroup
from .pump import Pump
from .records import Records
from .run_course import Ending, RunCourse
from .run_output import RunOutput
from .run_panel import RunPanel

__all__ = ["Ending", "Supervisor", "Wake"]  # (``Ending``: what ``watch`` says)


@dataclass(frozen=True)
class Wake:
    """Put on the events so the supervisor notices a cancel at once."""


class Supervisor:
    """One run's messages, read into its attempts, metrics, output and panel."""

    def __init__(self, group: RankGroup, config: RunConfig, records: Records,
                 stdout: TextIO, where: str, warm: bool = False,
                 quiet_when_quick: bool = False) -> None:
        """``warm``: ranks already up took the run (they said hello before it: a
        session's, once, as it started), so they run it from the start.
        ``quiet_when_quick``: see ``PanelState``."""
        self.group, self.config, self.records = group, config, records
        self.view = RankView(config.nprocs)
        """Each rank's step, speed and memory, live and after the run."""
        self.split = TimeSplit()
        """Where each rank's step time goes (data, compute, collectives)."""
        self._answering = config.rank_options.answering  # whose progress the bar shows
        self.history = History(len(config.running_ranks), records.metrics)  # (who logs)
        self.state = PanelState(config.nprocs, self.history, str(records.path),
                                where=where, quiet_when_quick=quiet_when_quick)
        self.panel = make_panel(stdout, quiet=config.output == "none")
        self.output = RunOutput(self.panel, records, config)
        """The ranks' output under the cell, and nbddp's own lines among it."""
        stall = StallWatch(group, config, records, self.state, self.output.note_now)
        self.shown = RunPanel(config, self.state, self.panel, self.output, stall,
                              self.view, self.split, self.history)
        """What the panel shows of the run, kept up to date and closed."""
        self.debugger = Debugger(group.send_to_rank, self.output.note_now)
        """pdb on the ranks: their prompts, for the thread waiting in ``Job.result()``."""
        self.pump = Pump(group.events, lambda: self.attempt.key, group.release_held)
        self.course = RunCourse(group, config, records, self.pump, stall, self.shown)
        """The run's attempts, and the decision of how it ended."""
        self._register()
        self.course.hooks = group.hooks(self)  # (its own events, its ranks' next run)
        if warm:
            self.attempt.started.update(config.running_ranks)
        if group.notice:
            self.output.write(group.notice + "\n")

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
        on(LauncherExited, self.course.heard_launcher_exit)
        self.pump.on_arrival(self.course.arrived)

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
        ending = self.course.ending
        if ending is not None and (ending.kind == "stopped" or isinstance(
                report, Disconnected) or secondary(report)):
            self.attempt.stopped.add(report.rank)

    # --- the run's course (``RunCourse``) -------------------------------------------------

    def watch(self, deadline: float | None, cancelled: Callable[[], str | None],
              seconds: float | None = None, pause: Callable[[], bool] = lambda: False
              ) -> Ending | None:
        """Follow the run until its ending is known; None if ``seconds`` passed first, or
        ``pause()`` turned true (the run is then followed on by a next ``watch``)."""
        return self.course.watch(deadline, cancelled, seconds, pause)

    @property
    def attempt(self) -> Attempt:
        """The ranks' current start: what each reported (each rank's state)."""
        return self.course.attempt

    @attempt.setter
    def attempt(self, attempt: Attempt) -> None:
        self.course.attempt = attempt

    @property
    def causes(self) -> list[Failure | Disconnected]:
        """Why each restart happened: the first cause of each failed attempt."""
        return self.course.causes

    def new_attempt(self, requeue: int, number: int, message: str, line: str) -> None:
        """The ranks start again (a torchrun restart, a SLURM requeue): what the last
        attempt said is over; say why, and follow the next one."""
        self.course.new_attempt(requeue, number, message, line)

    @property
    def running(self) -> set[int]:
        """The ranks that have not reported an end of this attempt (all, while it runs)."""
        return self.attempt.running

    @property
    def starting(self) -> set[int]:
        """The ranks of this attempt that have not said hello yet."""
        return self.attempt.starting

    @property
    def lost(self) -> bool:
        """A rank died, or the launcher ended: the group cannot run again."""
        return self.course.lost

    # --- what the user sees (``RunPanel``, ``RunOutput``) -----------------------------------

    @property
    def ended(self) -> bool:
        """The run is over: ranks that were still running were stopped."""
        return self.shown.ended

    @ended.setter
    def ended(self, ended: bool) -> None:
        self.shown.ended = ended

    def rank_states(self) -> list[str]:
        """Each rank's state now (see ``_run.attempts``); ``resting`` for a session's rank
        the run was not given to."""
        return self.shown.rank_states(self.attempt)

    def pump_output(self) -> None:
        """Show what the ranks wrote since the last look."""
        self.output.pump()

    def note_now(self, line: str) -> None:
        """A line of nbddp's own, after the ranks' output so far."""
        self.output.note_now(line)

    def release(self) -> None:
        """(The run is over, its end told) Drop what refers back to this supervisor: the
        pump's handlers and the backend's hooks. Its objects then go with its ``Job`` as
        soon as nothing refers to that, by reference counting. Left in cycles, a run's
        hundred objects made the garbage collector run every few cells (a no-op cell of
        a 2-rank session: 7% slower at the median, 14% on average)."""
        self.pump.close()
        self.course.hooks = GroupHooks(None)

    def close(self, status: str, message: str) -> None:
        """The run's last word: the last of the ranks' output, the rest of the history
        averaged, and the panel's final state (ranks still running were stopped)."""
        self.shown.close(self.attempt, status, message)

    @property
    def shown_state(self) -> PanelState:
        """The panel's state, with the ranks' final notes once the run is over."""
        return self.shown.shown_state

    def note(self, line: str) -> None:
        """Set the panel's last line (it may already be closed)."""
        self.shown.note(line)

    def wake(self) -> None:
        self.group.events.put(Wake())
