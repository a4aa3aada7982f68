"""How a run ends for its caller: one decision for every run and every ending.

A session's ranks stay if they are back at rest (its ``Staying`` says); others that did
not all return are stopped (every process, before anyone is told), and the channel and
run dir closed. Then the value or the error, the caller's ``after``, the panel's last
word, and the caller. Ranks that all returned and do not stay are seen off last: a
local run gives its value first, as its processes are ending by themselves and nothing
of them can outlive the kernel. A rank's failure becomes one ``WorkerError`` that names
the root cause.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any, Protocol

from .._errors import NbddpError, WorkerError
from .config import RunConfig
from .diagnosis.root_cause import describe, diagnose
from .groups.group import RankGroup
from .records import Records
from .results import run_value
from .supervisor import Ending, Supervisor

logger = logging.getLogger(__name__)


class Staying(Protocol):
    """The side of a run whose ranks may outlive it (a session's: ``_session``)."""

    def watch(self, supervisor: Supervisor) -> None:
        """Register, with ``supervisor.pump``, handlers for what only such ranks send."""

    def settle(self, supervisor: Supervisor, ending: Ending) -> bool:
        """The run ended: True if its ranks stay, back at rest with their state (brought
        back if it ended early); False if they are to be stopped."""

    def told(self, error: BaseException) -> BaseException:
        """The error the caller gets: ``error``, saying what became of the ranks' state."""

    def abandoned(self) -> bool:
        """The run could not end cleanly and its ranks were stopped: True if its end had
        not decided about them yet (then they are lost)."""


@dataclass(frozen=True)
class Outcome:
    """How a run ended for its caller: a value, or the error to raise."""

    value: Any = None
    error: BaseException | None = None


@dataclass
class RunEnd:
    """The end of one run on ``group``: what its caller is told, and when."""

    group: RankGroup
    config: RunConfig
    records: Records
    supervisor: Supervisor
    staying: Staying | None
    received: int = 0
    """The bytes of tensor and array data rank 0's result held (0 until read)."""

    def end(self, ending: Ending, after: Callable[[], None],
            publish: Callable[[Outcome], None], logs: Callable[[], dict[int, str]]) -> None:
        """The run's end (see the module): ``after`` is the caller's hook once the ranks
        ended the run themselves (or a session's run, however it ended); ``publish``
        tells ``result()`` (the first outcome stands); ``logs`` reads every rank's. (They
        are the Job's, and not kept: nothing here refers back to it, so a run's objects
        go by reference counting alone.)"""
        sup, group = self.supervisor, self.group
        returned = ending.kind == "returned"
        stays = self.staying is not None and self.staying.settle(sup, ending)
        stopping = not stays and not returned
        try:
            if stopping:
                group.stop()
            sup.pump.drain()
            outcome = self._value() if returned else Outcome(error=self._error(ending, logs))
        finally:
            if stopping:
                group.close()
        if ending.kind != "stopped" or self.staying is not None:
            call_after(after)
        sup.close(*_describe(outcome))
        if returned and not stays:
            if group.ends_after_result:
                publish(outcome)
            group.retire()
        publish(outcome)

    def _value(self) -> Outcome:
        """Every rank returned: the value the caller gets (an error if it cannot be read)."""
        try:
            return Outcome(run_value(self.supervisor.attempt.results, self.config.all_ranks,
                                     self.config.running_ranks, self._got))
        except NbddpError as exc:
            return Outcome(error=exc)

    def _got(self, data_bytes: int) -> None:
        self.received = data_bytes

    def _error(self, ending: Ending, logs: Callable[[], dict[int, str]]) -> BaseException:
        """Why the run ended: the ending's own error, or one built from every report."""
        sup = self.supervisor
        error = ending.error
        if error is None:
            error = diagnose(sup.attempt.failures, sup.attempt.results, self.group.run_dir,
                             self.records, self.config.nprocs, logs())
            if isinstance(error, WorkerError) and sup.attempt.number:
                error.attempts = sup.attempt.number + 1
                error.earlier = [describe(cause) for cause in sup.causes]
        return error if self.staying is None else self.staying.told(error)


def call_after(after: Callable[[], None]) -> None:
    """The caller's after-run hook; its failure is logged, never the run's."""
    try:
        after()
    except Exception:  # e.g. standby ranks that could not start: not this run's
        logger.exception("nbddp: after-run hook failed")


def _describe(outcome: Outcome) -> tuple[str, str]:
    """The panel's status word and one line for how the run ended (the panel's header
    and the summary line say it; the error IPython shows has the whole report)."""
    error = outcome.error
    if error is None:
        return "finished", ""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted", "every rank was stopped"
    if isinstance(error, CancelledError):
        return "cancelled", "every rank was stopped"
    first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
    # (one line: the whole report, stacks and all, is the exception's, shown once)
    return ("timed out" if isinstance(error, TimeoutError) else "failed"), first_line
