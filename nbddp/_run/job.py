"""``Job``: one run on a rank group, from hand-over to teardown, followed in a thread.

A ``Supervisor`` follows the run's messages and says how it ended. A caller that waits
for the run at once (``Session.run``, a session's cell) follows it itself for its first
``CALLER_FOLLOWS`` seconds, and a quick run that returns meanwhile ends there: handing
a run to a thread and back costs two wake-ups of a quick cell's few. A longer run, and
any other ending, goes on in a follower thread, as every run does otherwise, so that
the caller serves pdb's prompts and takes Ctrl-C while it waits. Then the run ends,
in one place (``_run.run_end``). A run whose ranks all returned has its value at once,
and its processes (already exiting) are seen off in the background: ``result()``
returns, and ``done()`` turns true once they are gone.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Generic, NoReturn, TextIO, TypeVar

from .._errors import NbddpError
from .config import RunConfig
from .diagnosis.debugger import INTERRUPTED
from .followers import follow, let_go
from .groups.group import RankGroup
from .interrupt_hold import InterruptHold, held_while
from .records import Records
from .run_end import Outcome, RunEnd, Staying, call_after
from .run_readings import RunReadings
from .supervisor import Ending, Supervisor

logger = logging.getLogger(__name__)
R = TypeVar("R")

CALLER_FOLLOWS = 0.1
"""Seconds a caller that waits at once follows its run itself (see the module): meanwhile
Ctrl-C is noted (it ends this and stops the run) and pdb's prompts wait."""


class Job(RunReadings, Generic[R]):
    """A launched run. ``result()`` waits for it; ``cancel()`` stops it; ``done()`` asks."""

    cluster_job_id: str | None = None
    """The cluster's own id for the run's job (SLURM's job id, a Ray session's id): what
    ``nbddp.attach`` takes. None for a run on this machine."""
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
        self.config, self.warm, self.cluster_job_id = config, warm, group.cluster_job_id
        self._group, self._records, self._after = group, records, after
        self._staying = staying
        self._sent = sent
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
        self._ending = RunEnd(group, config, records, self._supervisor, staying)
        let_go(Job._latest)  # (the run before: its result is freed off this path)
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
        ``InterruptHold``): ``result()``, or ``handed_back`` for a caller that does
        not wait, acts on a press. (Inside another hold, this one holds nothing.)"""
        job, hold = held_while(start)
        job._hold = hold
        return job

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
    def slurm_job_id(self) -> str | None:
        """Deprecated: ``cluster_job_id``, which every cluster kind sets."""
        warnings.warn("Job.slurm_job_id is now Job.cluster_job_id (slurm_job_id will go in "
                      "a later release)", DeprecationWarning, stacklevel=2)
        return self.cluster_job_id

    # --- ending ---------------------------------------------------------------------

    def _supervise(self, ending: Ending | None = None) -> None:
        """Follow the run (from ``ending``, if already known) and end it."""
        try:
            ending = ending or self._watch()
            assert ending is not None
            self.ended_by = ending.kind
            self._ending.end(ending, self._call_after, self._publish, lambda: self.logs)
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
            call_after(self._call_after)  # the session starts fresh ranks
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

    def _call_after(self) -> None:
        if self._after is not None:
            self._after(self)

    def _publish(self, outcome: Outcome) -> None:
        """Tell ``result()`` (once: the first outcome stands)."""
        if not self._ended.is_set():
            self._outcome = outcome
            self._ended.set()


# --- nbddp's own calls on a Job (the front door's and the backends'), not a user's -----


def handed_back(job: Job[R]) -> Job[R]:
    """The caller takes ``job`` without waiting for it (``launch(wait=False)``): Ctrl-C
    raises again, and a press while the run started stops it now (and raises)."""
    __tracebackhide__ = True
    try:
        job._let_go()
    except KeyboardInterrupt as interrupt:
        job._stop_interrupted(interrupt)
    return job


def followed_after_all(job: Job) -> None:
    """The caller that was to follow ``job``'s start raised before it waited: a follower
    thread follows the run instead (which ends it, and frees its ranks)."""
    if job._caller_follows:
        job._caller_follows = False
        job._follow()


def note_under(job: Job, line: str) -> None:
    """Show ``line`` as the panel's last line (standby ranks' state, a session's fresh
    ranks), even after the run: it goes under the cell that launched ``job``."""
    job._context.copy().run(job._supervisor.note, line)


def data_bytes(job: Job) -> tuple[int, int]:
    """The bytes of tensor and array data ``job``'s run sent (its payload) and got back
    (rank 0's result; 0 until read): the next run's rooms are made that large."""
    return job._sent, job._ending.received
