"""A run's course: its attempts, followed until its ending is known.

After each event the supervisor dispatched, this decides whether the run has ended:
every rank returned, a rank raised or died (the first one is the root cause; with
restarts left, torchrun starts every rank again instead, and the next attempt is
followed), the launcher ended early (maybe after attempts quicker than the kernel
followed), a timeout, or a cancel. It does not stop anything itself; the ``Job`` does
that with the ending.

Kept apart from the handlers that read the ranks' messages into the current attempt:
those say what happened, this says what it means for the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any, Literal

from .._errors import NbddpError
from .._wire.messages import Disconnected, Failure
from .attempts import Attempt
from .config import RunConfig
from .diagnosis.root_cause import describe, first_cause, peer_lost
from .diagnosis.stall_watch import StallWatch
from .groups.group import GroupHooks, LauncherExited, RankGroup
from .pump import Numbered, Pump
from .records import Records
from .run_panel import RunPanel

_DEATH_REPORT_WAIT = 2.0  # how long torchrun may take to report a rank that died
_RESTART_GATHER = 1.0  # how long a failed attempt's other reports may take to come in
_LINKS_END_WAIT = 2.0  # how long the ranks' links' ends may come after torchrun's


@dataclass(frozen=True)
class Ending:
    """What decided a run's end: every rank ``returned``, a rank ``failed`` (the error
    is built from every report once the group is stopped), or the kernel ``stopped``
    it (``error`` says why: interrupt, cancel, timeout...)."""

    kind: Literal["returned", "failed", "stopped"]
    error: BaseException | None = None


class RunCourse:
    """One run's attempts and causes of restarts, and the decision of how it ended."""

    def __init__(self, group: RankGroup, config: RunConfig, records: Records, pump: Pump,
                 stall: StallWatch, shown: RunPanel) -> None:
        self._group, self._config, self._records = group, config, records
        self._pump, self._stall, self._shown = pump, stall, shown
        self.attempt = Attempt(config.nprocs)
        """The ranks' current start: what each reported (each rank's state)."""
        self.causes: list[Failure | Disconnected] = []
        """Why each restart happened: the first cause of each failed attempt."""
        self._attempts_seen: set[tuple[int, int]] = {self.attempt.key}
        """The (requeue, restart) of every attempt that a rank's message came from."""
        self.launcher_exited = False
        self.ending: Ending | None = None
        """How the run ended, once that is decided."""
        self.hooks = GroupHooks(None)
        """The backend's part: its ranks' next run, why it ended (``RankGroup.hooks``)."""

    def heard_launcher_exit(self, event: LauncherExited) -> None:
        self.launcher_exited = True

    def arrived(self, message: Numbered) -> None:
        """Note which attempt sent ``message`` (held or stale ones too): proof that
        torchrun started that attempt, even if the run is no longer followed there."""
        self._attempts_seen.add((message.requeue, message.attempt))

    @property
    def lost(self) -> bool:
        """A rank died, or the launcher ended: the group cannot run again."""
        return self.launcher_exited or any(isinstance(f, Disconnected)
                                           for f in self.attempt.failures)

    def watch(self, deadline: float | None, cancelled: Callable[[], str | None],
              seconds: float | None = None, pause: Callable[[], bool] = lambda: False
              ) -> Ending | None:
        """Follow the run until its ending is known; None if ``seconds`` passed first, or
        ``pause()`` turned true (the run is then followed on by a next ``watch``)."""
        shown = self._shown
        self._pump.run(lambda: self.ending is not None or pause(), seconds,
                       gate=lambda: self._going_on(deadline, cancelled),
                       then=self._decide,
                       turn=lambda: shown.refresh_now_and_then(self.attempt))
        return self.ending

    def _going_on(self, deadline: float | None, cancelled: Callable[[], str | None]) -> bool:
        """False once the run was interrupted, cancelled or timed out (its ending set)."""
        reason = cancelled()
        if reason == "interrupted":
            self.ending = Ending("stopped", self._with_stacks(KeyboardInterrupt, ""))
        elif reason:
            self.ending = Ending("stopped", CancelledError(
                "the run was cancelled; every rank was stopped"))
        elif deadline is not None and time.monotonic() > deadline:
            self.ending = Ending("stopped", self._with_stacks(
                TimeoutError, f"the run did not finish within {self._config.timeout:g} s; "
                              "every rank was stopped"))
        return self.ending is None

    def _with_stacks(self, kind: type[BaseException], message: str) -> BaseException:
        return self._stall.error_with_stacks(kind, message, self.attempt)

    def _decide(self, event: Any) -> None:
        """After each event while the run goes on: the run's ending, if it decides it."""
        if self.attempt.failed_with(event):
            self.ending = self._failed(event)
        elif self.attempt.returned:
            self.ending = Ending("returned")  # the launcher's own end is not worth waiting for
        elif isinstance(event, LauncherExited):
            self.ending = self._launcher_ended()

    def _failed(self, event: Failure | Disconnected) -> Ending | None:
        """A rank raised or died: the run's end, unless the ranks start again."""
        if self.hooks.moved_on():
            return None  # the backend follows its ranks' next run (a SLURM requeue)
        if self.attempt.number < self._config.max_restarts:
            return self._restarting()
        if isinstance(event, Disconnected) or peer_lost(event):
            # A rank died, or one lost its peer (which may be the one that died):
            # let torchrun say how the ranks ended before everything is stopped.
            self._pump.run(lambda: self.launcher_exited, _DEATH_REPORT_WAIT)
            return self._stopped_from_outside() or Ending("failed")
        return Ending("failed")

    def _restarting(self) -> Ending | None:
        """A rank failed with restarts left: torchrun stops every rank and starts them
        again. Gather this attempt's other reports (the rank that raised may be heard of
        after a peer whose collective broke), say why, and follow the next one. If
        torchrun ended meanwhile, the run has ended, maybe in a later attempt: its
        attempts can be quicker than this wait (see ``_launcher_ended``)."""
        self._pump.run(lambda: self.launcher_exited, _RESTART_GATHER)
        if self.launcher_exited:
            return self._launcher_ended()
        self._restart()
        return None

    def _restart(self) -> None:
        """Say why this attempt failed (its root cause), keep its tracebacks, and follow
        the next one."""
        cause = first_cause(self.attempt.failures)
        self.causes.append(cause)
        self.attempt.keep_tracebacks(self._records)
        number = self.attempt.number + 1
        message = f"restart {number} of {self._config.max_restarts}: {describe(cause)}"
        self.new_attempt(self.attempt.requeue, number, message, f"nbddp: {message}\n")

    def _follow_restarts(self) -> None:
        """torchrun ended: follow each attempt it started after the one followed, whose
        messages wait in the pump, so that the run's error is its last attempt's and
        every restart is counted."""
        while (self.attempt.failures and self.attempt.number < self._config.max_restarts
               and (self.attempt.requeue, self.attempt.number + 1) in self._attempts_seen):
            self._restart()
            self._pump.drain()  # (the next attempt's messages, held until now)

    def new_attempt(self, requeue: int, number: int, message: str, line: str) -> None:
        """The ranks start again (a torchrun restart, a SLURM requeue): what the last
        attempt said is over; say why, and follow the next one."""
        self.attempt = Attempt(self._config.nprocs, requeue, number)
        self._shown.restarted(self.attempt, message, line)

    def _launcher_ended(self) -> Ending:
        """torchrun or the batch job ended before every rank returned (as far as the
        kernel has heard: where it hears its ranks' links close, it waits up to
        ``_LINKS_END_WAIT`` for every rank that said hello to be heard of first)."""
        self._group.sync()  # what the ranks wrote just before it ended
        self._pump.drain()
        self._follow_restarts()
        if not self.attempt.returned and self._group.hears_link_ends:
            self._pump.run(self._every_started_rank_heard_of, _LINKS_END_WAIT)
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
        stopped = self._group.stopped_from_outside()
        if stopped is None:
            return None
        return Ending("stopped", NbddpError(
            f"{stopped} before every rank returned; the ranks' output is in "
            f"{self._records.path}"))
