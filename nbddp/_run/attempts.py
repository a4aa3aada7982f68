"""One attempt of a run: what its ranks reported, and so each rank's state.

The ranks may start again within one run: torchrun restarts every rank after a failure
(``max_restarts``), and SLURM requeues a job, which runs it again from torchrun's first
attempt. Each such start is an ``Attempt``, numbered by the requeue and the restart that
the ranks' messages carry. It is the one owner of what each rank said: returned, raised,
died, asked for a requeue, started, sits in pdb. A rank's state (``starting``,
``running``, ``debugging``, ``finished``, ``failed``, ``requeueing``, and ``stopped``
once the run has ended, or where a rank ended only because nbddp, or torchrun after
another rank's failure, stopped it) is read from these; the panel and ``Job.ranks``
show it.
"""

from __future__ import annotations

from .._wire.messages import Disconnected, Failure, Result
from .diagnosis.root_cause import first_cause, secondary
from .records import Records

NOTHING_BACK = Result(-1)
"""The result of a rank that returned and had nothing to send back (no value, no names):
only its rank's place in ``Attempt.results`` says whose it is."""


class Attempt:
    """The reports of one start of every rank: requeue ``requeue``, restart ``number``."""

    def __init__(self, nprocs: int, requeue: int = 0, number: int = 0) -> None:
        self.nprocs, self.requeue, self.number = nprocs, requeue, number
        self.results: dict[int, Result] = {}
        self.failures: list[Failure | Disconnected] = []
        """Ranks that raised, or died without a word: root-cause candidates, in order."""
        self.requeueing: set[int] = set()
        """Ranks that ended this run of the job with ``nbddp.requeue()``."""
        self.started: set[int] = set()
        """Ranks that said hello (or came back from pdb) in this attempt."""
        self.debugging: set[int] = set()
        """Ranks whose pdb waits for a line."""
        self.stopped: set[int] = set()
        """Ranks that raised or died once the run's end was decided: nbddp (or torchrun,
        after another rank's failure) stopped them."""

    def finished_quietly(self, ranks: tuple[int, ...]) -> None:
        """``ranks`` returned with nothing to send back (a node's relay says so for its
        ranks at once): each one's result is ``NOTHING_BACK``, one object for them all,
        not thousands of the same."""
        self.results.update(dict.fromkeys(ranks, NOTHING_BACK))

    @property
    def key(self) -> tuple[int, int]:
        """What the ranks' messages carry: (requeue, restart)."""
        return self.requeue, self.number

    def vanished(self, rank: int) -> bool:
        """True if ``rank`` disconnected without returning or reporting an exception."""
        return rank not in self.results and not self._failed(rank)

    def _failed(self, rank: int) -> bool:
        return any(failure.rank == rank for failure in self.failures)

    def failed_with(self, event: object) -> bool:
        """True if ``event`` (already recorded) is one of this attempt's failures."""
        return any(failure is event for failure in self.failures)

    @property
    def reported(self) -> set[int]:
        """Ranks that returned or raised in this attempt (and so are done with it)."""
        return (set(self.results) | self.requeueing
                | {f.rank for f in self.failures if isinstance(f, Failure)})

    @property
    def returned(self) -> bool:
        """Every rank returned."""
        return len(self.results) == self.nprocs

    @property
    def running(self) -> set[int]:
        """The ranks that have not reported an end of this attempt (all, while it runs)."""
        return set(range(self.nprocs)) - self.reported

    @property
    def starting(self) -> set[int]:
        """The ranks of this attempt that have not said hello yet."""
        return set(range(self.nprocs)) - self.started

    def state(self, rank: int, ended: bool = False) -> str:
        """``rank``'s state, for the panel and ``Job.ranks``; a rank still running when
        the run ``ended`` was ``stopped``."""
        if rank in self.results:
            return "finished"
        if self._failed(rank):  # (a stopped rank's report is among the failures too)
            return "failed" if self._a_cause(rank) else "stopped"
        if rank in self.requeueing:
            return "requeueing"
        if rank in self.debugging:
            return "debugging"
        if rank in self.started:
            return "stopped" if ended else "running"
        return "stopped" if ended else "starting"  # (stopped before it said hello)

    def _a_cause(self, rank: int) -> bool:
        """``rank`` failed of itself: it raised (not only because a peer was lost or nbddp
        interrupted it), or it is the run's first cause, before the run's end was decided."""
        if rank in self.stopped:
            return False
        return first_cause(self.failures).rank == rank or any(
            failure.rank == rank and isinstance(failure, Failure) and not secondary(failure)
            for failure in self.failures)

    def states(self, ended: bool = False) -> list[str]:
        """Every rank's ``state``, read from each set once (not rank by rank: a run may
        have thousands of ranks, and many failures after an interrupt)."""
        running = "stopped" if ended else "running"
        if len(self.started) == self.nprocs:  # (a session's warm ranks: every one)
            states = [running] * self.nprocs
        else:  # (the run may have been stopped before a rank said hello: a timeout while
            states = ["stopped" if ended else "starting"] * self.nprocs  # torch imports)
            for rank in tuple(self.started):
                states[rank] = running
        for ranks, state in ((self.debugging, "debugging"), (self.requeueing, "requeueing")):
            for rank in tuple(ranks):  # (a copy: the panel may ask while reports come)
                states[rank] = state
        failures = list(self.failures)
        if failures:
            cause = first_cause(failures).rank
            raised = {failure.rank for failure in failures
                      if isinstance(failure, Failure) and not secondary(failure)}
            stopped = set(self.stopped)
            for failure in failures:
                rank = failure.rank
                states[rank] = "failed" if rank not in stopped and (
                    rank == cause or rank in raised) else "stopped"
        for rank in tuple(self.results):
            states[rank] = "finished"
        return states

    def keep_tracebacks(self, records: Records) -> None:
        """Append what each rank raised to its log, where the next attempt's output
        follows: every attempt's story stays in the records."""
        for failure in self.failures:
            if isinstance(failure, Failure) and failure.traceback:
                with open(records.rank_log(failure.rank), "a") as log:
                    log.write(f"nbddp: attempt {self.number + 1} of rank {failure.rank} "
                              f"failed:\n{failure.traceback.rstrip()}\n")
