"""``Job``: one run on a rank group, from hand-over to teardown, followed in a thread.

A ``Supervisor`` follows the run's messages and says how it ended. A caller that waits
for the run at once (``Session.run``, a session's cell) follows it itself for its first
``CALLER_FOLLOWS`` seconds, and a quick run that returns meanwhile ends there: handing
a run to a thread and back costs two wake-ups of a quick cell's few. A longer run, and
any other ending, goes on in a follower thread, as every run does otherwise, so that
the caller serves pdb's prompts and takes Ctrl-C while it waits. Then the job ends
the run, in one place (``_end``). A run whose ranks all returned has its value at once,
and its processes (already exiting) are seen off in the background: ``result()``
returns, and ``done()`` turns true once they are gone. A session's ranks stay for the
next run if they come back to rest (its ``Staying`` says). Any other ending stops every
process, closes the channel and removes the run dir before anyone is told; a rank's
failure becomes one ``WorkerError`` that names the root cause.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, NoReturn, Protocol, TextIO, TypeVar

from .._errors import NbddpError, WorkerError
from .._panel.state import PanelState
from .._wire.history import read_history
from .config import RunConfig
from .debugger import INTERRUPTED
from .diagnosis import describe, diagnose
from .followers import follow
from .group import RankGroup
from .hang_report import ask_for_report
from .interrupt_hold import InterruptHold, held_while
from .records import Records
from .results import run_value
from .supervisor import Ending, Supervisor

logger = logging.getLogger(__name__)
R = TypeVar("R")

CALLER_FOLLOWS = 0.1
"""Seconds a caller that waits at once follows its run itself (see the module): meanwhile
Ctrl-C is noted (it ends this and stops the run) and pdb's prompts wait."""


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


class Job(Generic[R]):
    """A launched run. ``result()`` waits for it; ``cancel()`` stops it; ``done()`` asks."""

    slurm_job_id: str | None = None
    """The SLURM job id of a run submitted to SLURM; None for a local run."""
    warm: bool = False
    """True if the run was handed to standby ranks that were already waiting for it."""
    ended_by: str | None = None
    """``"returned"``, ``"failed"`` (a rank raised or died) or ``"stopped"`` (interrupt,
    cancel, timeout) once the run has ended."""
    _latest: Job | None = None  # what last_job() returns

    def __init__(self, group: RankGroup, config: RunConfig, records: Records, *,
                 stdout: TextIO | None = None, warm: bool = False, sent: int = 0,
                 after: Callable[[Job], None] | None = None,
                 staying: Staying | None = None, where: str | None = None,
                 caller_waits: bool = False, quiet_when_quick: bool = False) -> None:
        """Follow the run ``group`` was handed (``sent``: the bytes of tensor and array
        data its payload holds). ``after`` runs once the ranks have ended it themselves
        (returned or failed; a session's run, however it ended), before the caller is
        told. ``staying``: the session's side of a run on its ranks. ``where``: where
        the panel says the run runs (default: the group's ``where``). ``caller_waits``:
        the caller calls ``result()`` next, under its ``started_held`` hold, and follows
        the run's start itself (see the module). ``quiet_when_quick``: a quick run that
        finishes prints no summary line (``PanelState.quiet_end``)."""
        self.config, self.warm, self.slurm_job_id = config, warm, group.slurm_job_id
        self._group, self._records, self._after = group, records, after
        self._staying = staying
        self._sent, self._received = sent, 0
        self._cancel_reason: str | None = None
        self._hold: InterruptHold | None = None  # Ctrl-C held while the run started
        self._outcome: Outcome | None = None
        self._ended = threading.Event()  # the outcome is known
        self._finished = threading.Event()  # ... and every process is gone
        self._started = time.monotonic()
        self._context = contextvars.copy_context()
        self._supervisor = Supervisor(group, config, records, stdout or sys.stdout,
                                      group.where if where is None else where, warm=warm,
                                      quiet_when_quick=quiet_when_quick)
        if staying is not None:
            staying.watch(self._supervisor)
        Job._latest = self
        self._caller_follows = caller_waits
        if not caller_waits:
            self._follow()

    def _follow(self, ending: Ending | None = None) -> None:
        """Hand the run to a follower thread (which ends it: from ``ending``, if known).
        The caller's context goes along, so a notebook routes the output to the cell
        that launched the run even while other cells execute (ipykernel >= 7)."""
        follow(functools.partial(self._context.copy().run, self._supervise, ending))

    # --- public ---------------------------------------------------------------------

    def done(self) -> bool:
        """True once the run has ended and everything it started is gone."""
        return self._finished.is_set()

    def cancel(self) -> bool:
        """Stop every rank and wait until they are gone; False if the run had already ended."""
        if self._ended.is_set():
            self._finished.wait()
            return False
        self._cancel_reason = self._cancel_reason or "cancelled"
        self._supervisor.wake()
        self._finished.wait()
        return True

    def result(self, timeout: float | None = None) -> R:
        """Rank 0's return value (every rank's with ``all_ranks``), or the run's error.

        ``timeout`` bounds this wait only. Interrupting the wait (Ctrl-C, the
        notebook's stop button) stops the run and re-raises ``KeyboardInterrupt``.
        """
        __tracebackhide__ = True  # IPython shows the user's call, not nbddp's frames
        deadline = None if timeout is None else time.monotonic() + timeout
        debugger = self._supervisor.debugger
        debugger.serving.set()  # a rank's pdb may ask this thread for input
        try:
            self._follow_first()
            self._let_go()
            while not self._ended.wait(0.1):
                debugger.serve()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the run is still going after {timeout} s")
        except KeyboardInterrupt as interrupt:
            self._stop_interrupted(interrupt)
        finally:
            debugger.stop_serving()
        assert self._outcome is not None
        if self._outcome.error is not None:
            raise self._outcome.error
        return self._outcome.value

    @staticmethod
    def started_held(start: Callable[[], Job[R]]) -> Job[R]:
        """``start()``'s Job, with Ctrl-C held back while the run starts (see
        ``InterruptHold``): ``result()``, or ``_handed_back()`` for a caller that does
        not wait, acts on a press. (Inside another hold, this one holds nothing.)"""
        job, hold = held_while(start)
        job._hold = hold
        return job

    def _handed_back(self) -> Job[R]:
        """The caller takes the Job without waiting for it: Ctrl-C raises again, and a
        press while the run started stops it now (and raises)."""
        __tracebackhide__ = True
        try:
            self._let_go()
        except KeyboardInterrupt as interrupt:
            self._stop_interrupted(interrupt)
        return self

    def _follow_first(self) -> None:
        """(The caller, still holding Ctrl-C back, if it was made to follow the run's
        start) Follow the run for ``CALLER_FOLLOWS`` s, or until Ctrl-C is pressed; end it
        here if it returned meanwhile, else hand it to a follower thread. Where nothing
        holds Ctrl-C back (another thread than the main one), a thread follows it all."""
        if not self._caller_follows:
            return
        self._caller_follows = False
        hold, ending = self._hold, None
        if hold is not None and hold.holding:
            ending = self._watch(CALLER_FOLLOWS, pause=lambda: hold.pressed)
            if ending is not None and ending.kind == "returned":
                self._supervise(ending)
                return
        try:
            self._follow(ending)
        except BaseException as exc:  # (no thread could take it: the run ends here)
            try:
                self._end_broken(exc)
            finally:
                self._finish()

    def _followed_after_all(self) -> None:
        """The caller that was to follow the run's start raised before it waited: a
        follower thread follows the run instead (which ends it, and frees its ranks)."""
        if self._caller_follows:
            self._caller_follows = False
            self._follow()

    def _let_go(self) -> None:
        """Ctrl-C raises again; ``KeyboardInterrupt`` if it was pressed while held. (Only
        the main thread, which holds it, lets it go: another thread waiting in
        ``result()`` meanwhile leaves it.)"""
        hold = self._hold
        if hold is None or (hold.holding and
                            threading.current_thread() is not threading.main_thread()):
            return
        self._hold = None
        hold.release()

    def _stop_interrupted(self, interrupt: KeyboardInterrupt) -> NoReturn:
        """Ctrl-C: stop the run, then raise its ``KeyboardInterrupt`` (which may say what
        became of a session's state). A rank in pdb goes on: it can be stopped."""
        __tracebackhide__ = True
        self._cancel_reason = "interrupted"
        self._supervisor.debugger.stop_serving(INTERRUPTED)
        self.cancel()
        if self._outcome is not None and isinstance(self._outcome.error, KeyboardInterrupt):
            raise self._outcome.error from None
        raise interrupt

    @property
    def state(self) -> PanelState:
        """What the live panel shows now: status, each rank's state, progress, metrics."""
        return self._supervisor.shown_state

    @property
    def logs(self) -> dict[int, str]:
        """Every rank's output so far, by rank, read from the run's records folder."""
        return self._records.read_logs(self.config.nprocs)

    @property
    def records(self) -> Path:
        """The folder that keeps this run's full per-rank logs and metrics history."""
        return self._records.path

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every step's rank-averaged metrics so far: dicts with ``step``, ``ranks`` and
        each metric (read from the run's records, so complete however long the run)."""
        return read_history(self._records.metrics)

    def stacks(self, full: bool = False) -> dict[int, str]:
        """``{rank: text}``: every running rank's Python stacks, taken while the run goes
        on, e.g. to see where a run hangs. Each reads like a traceback: a summary line
        (``rank 0: waiting in barrier (Cell In[3], line 9)``), then the main thread, most
        recent call last, with source lines, then the user's other threads. torch's
        internals are folded and nbddp's frames and threads left out, unless ``full``.
        A SLURM job's ranks answer over the channel, where they reach the kernel. Empty
        once the ranks are gone."""
        return self._group.stacks(full=full)

    def hang_report(self) -> str:
        """Where each running rank is in its collectives, from torch's flight recorder:
        the last one it completed and the one it waits in, numbered per process group,
        and which ranks a waiting collective still waits for (``rank 0 waits in
        all_reduce #12`` / ``rank 1 has completed #11 and is not in a collective``).
        With ``stacks()``, what to read when a run hangs."""
        if self.done():
            return "the run has ended: no rank is in a collective"
        if not self._group.can_ask:
            return ("the kernel cannot ask these ranks: they have no channel to it (they "
                    "report through files)")
        return ask_for_report(self._group, self._supervisor.running, self._supervisor.starting)

    @property
    def restarts(self) -> int:
        """How many times torchrun has restarted every rank in this run (``max_restarts``)."""
        return self._supervisor.attempt.number

    @property
    def ranks(self) -> dict[int, dict[str, Any]]:
        """``{rank: {...}}``, live and after the run: ``state``, ``step`` (its last step
        logged, or its progress), ``steps_per_s``, ``rss_mb``, ``gpu_mem_mb`` (None without
        CUDA), ``pid``, ``host``, ``behind`` (its step trails the others'), and
        ``step_split``: the shares of its step time spent waiting for ``data``,
        ``compute``-ing and waiting in ``collectives``, with its ``seconds`` per step,
        over its last ten seconds (None before its steps are timed)."""
        supervisor = self._supervisor
        ranks = supervisor.view.ranks(supervisor.rank_states())
        splits = supervisor.split.splits()
        for rank, info in ranks.items():
            split = splits.get(rank)
            info["step_split"] = None if split is None else {
                "data": split.data, "compute": split.compute,
                "collectives": split.collectives if split.collectives_measured else None,
                "seconds": split.seconds}
        return ranks

    @property
    def requeues(self) -> int:
        """How many times SLURM has requeued this run's job (each runs it again)."""
        return self._supervisor.attempt.requeue

    @property
    def _data_bytes(self) -> tuple[int, int]:
        """The bytes of tensor and array data the run sent (its payload) and got back
        (rank 0's result; 0 until read): the next run's rooms are made that large."""
        return self._sent, self._received

    # --- ending ---------------------------------------------------------------------

    def _supervise(self, ending: Ending | None = None) -> None:
        """Follow the run (from ``ending``, if already known) and end it."""
        try:
            ending = ending or self._watch()
            assert ending is not None
            self.ended_by = ending.kind
            self._end(ending)
        except BaseException as exc:  # a bug here must not leave the run going
            self._end_broken(exc)
        finally:
            self._finish()

    def _finish(self) -> None:
        """(The run is over, however it ended) Drop what refers back to the supervisor,
        and ``done()`` turns true."""
        self._supervisor.release()
        self._finished.set()

    def _end_broken(self, exc: BaseException) -> None:
        """nbddp itself could not follow or end the run: stop its ranks, and say so."""
        logger.error("nbddp could not end the run cleanly", exc_info=exc)
        with contextlib.suppress(BaseException):
            self._group.stop()
            self._group.close()
        if self._staying is not None and self._staying.abandoned():
            self._call_after()  # the session starts fresh ranks
        self._publish(Outcome(error=NbddpError(f"nbddp failed to end the run: {exc!r}")))

    def _watch(self, seconds: float | None = None, pause: Callable[[], bool] = lambda: False
               ) -> Ending | None:
        """The run's ending (None: not within ``seconds``, or ``pause()`` turned true)."""
        deadline = None if self.config.timeout is None else self._started + self.config.timeout
        try:
            return self._supervisor.watch(deadline, lambda: self._cancel_reason, seconds,
                                          pause)
        except Exception as exc:
            logger.exception("nbddp supervisor failed")
            return Ending("stopped", NbddpError(f"nbddp supervisor failed: {exc!r}"))

    def _end(self, ending: Ending) -> None:
        """The run's end, one decision for every run and ending. A session's ranks stay
        if they are back at rest; others that did not all return are stopped (every
        process, before anyone is told), and the channel and run dir closed. Then the
        value or the error, ``after`` (unless the kernel stopped a run of its own), the
        panel's last word, and the caller. Ranks that all returned and do not stay are
        seen off last: a local run gives its value first, as its processes are ending by
        themselves and nothing of them can outlive the kernel."""
        sup, group = self._supervisor, self._group
        returned = ending.kind == "returned"
        stays = self._staying is not None and self._staying.settle(sup, ending)
        stopping = not stays and not returned
        try:
            if stopping:
                group.stop()
            sup.pump.drain()
            outcome = self._value() if returned else Outcome(error=self._error(ending))
        finally:
            if stopping:
                group.close()
        if ending.kind != "stopped" or self._staying is not None:
            self._call_after()
        self._end_panel(outcome)
        if returned and not stays:
            if group.ends_after_result:
                self._publish(outcome)
            group.retire()
        self._publish(outcome)

    def _value(self) -> Outcome:
        """Every rank returned: the value the caller gets (an error if it cannot be read)."""
        try:
            return Outcome(run_value(self._supervisor.attempt.results, self.config.all_ranks,
                                     self.config.running_ranks, self._got))
        except NbddpError as exc:
            return Outcome(error=exc)

    def _got(self, data_bytes: int) -> None:
        self._received = data_bytes

    def _error(self, ending: Ending) -> BaseException:
        """Why the run ended: the ending's own error, or one built from every report."""
        sup = self._supervisor
        error = ending.error
        if error is None:
            error = diagnose(sup.attempt.failures, sup.attempt.results, self._group.run_dir,
                             self._records, self.config.nprocs, self.logs)
            if isinstance(error, WorkerError) and sup.attempt.number:
                error.attempts = sup.attempt.number + 1
                error.earlier = [describe(cause) for cause in sup.causes]
        return error if self._staying is None else self._staying.told(error)

    def _call_after(self) -> None:
        if self._after is not None:
            try:
                self._after(self)
            except Exception:  # e.g. standby ranks that could not start: not this run's
                logger.exception("nbddp: after-run hook failed")

    def _publish(self, outcome: Outcome) -> None:
        """Tell ``result()`` (once: the first outcome stands)."""
        if not self._ended.is_set():
            self._outcome = outcome
            self._ended.set()

    def _end_panel(self, outcome: Outcome) -> None:
        self._supervisor.close(*_describe(outcome))

    def _note(self, line: str) -> None:
        """Show ``line`` as the panel's last line (standby ranks' state), even after the
        run: it goes under the cell that launched the run."""
        self._context.copy().run(self._supervisor.note, line)


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
