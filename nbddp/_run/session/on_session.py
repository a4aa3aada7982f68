"""One run on a session's ranks, as its ``Job`` sees it: whether the ranks stay for the
next run with their state, and what the error says about it.

A run that ends early (a rank raised, an interrupt, a timeout) keeps the ranks if every
one comes back to rest within ``SETTLE_SECONDS``; otherwise the session replaces them,
and the error says that the state is gone.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..._errors import WorkerError
from ..._wire.messages import Assigned, Failure, Result
from ..._wire.snapshot_orders import RestoreNote
from ..groups.waiting import WaitingGroup
from ..supervisor import Ending, Supervisor

SETTLE_SECONDS = 10.0
"""How long a session's ranks may take to come back to rest after a failure, an
interrupt or a timeout before they are restarted (a rank stuck in a collective whose
peer left never comes back by itself)."""
STATE_KEPT = "the session's ranks are back at rest, with their state"
STATE_LOST = "the session was restarted: variables defined in earlier cells are gone"


def with_session_note(error: BaseException, kept: bool,
                      restored: str | None = None) -> BaseException:
    """``error``, saying whether the session's state was kept (or what fresh ranks will
    restore of it: ``restored``)."""
    note = STATE_KEPT if kept else restored or STATE_LOST
    if isinstance(error, WorkerError):
        error.note = note
        return error
    message = str(error).replace("; every rank was stopped", "")
    if isinstance(error, KeyboardInterrupt):
        message = "every rank was interrupted" + (f"\n{message}" if message else "")
    first, newline, rest = message.partition("\n")  # (then where each rank was)
    renamed = type(error)(f"{first}; {note}{newline}{rest}" if first else note)
    renamed.__cause__ = error.__cause__
    for found in ("stacks", "hang_report"):  # what the run saw before it stopped the ranks
        if hasattr(error, found):
            setattr(renamed, found, getattr(error, found))
    return renamed


class OnSession:
    """One run on the session's ranks, as its ``Job`` sees it (``Staying``): the names
    the ranks' code bound (the answering rank's report carries them), and whether the
    ranks stay for the next run, with their state."""

    def __init__(self, group: WaitingGroup,
                 when_lost: Callable[[], str | None] = lambda: None,
                 restoring: bool = False) -> None:
        """``when_lost``: what fresh ranks will restore, if the ranks are lost;
        ``restoring``: the ranks restore a snapshot first (unless each one does, they do
        not hold the session's state: they are replaced)."""
        self._group = group
        self._when_lost = when_lost
        self._restoring = restoring
        self.restore_failed = False
        self.kept: bool | None = None
        """Whether the ranks kept their state: None until the run's end decided it."""
        self.returned = False
        """Every rank returned (so each took the run's payload whole)."""
        self.names: tuple[str, ...] | None = None
        self.restored: dict[int, RestoreNote] = {}
        """What each rank loaded from a snapshot before the run."""

    def watch(self, supervisor: Supervisor) -> None:
        for kind in (Assigned, Result, Failure):
            supervisor.pump.on(kind, self._assigned)

    def _assigned(self, message: Assigned | Result | Failure) -> None:
        names = message.names if isinstance(message, Assigned) else message.assigned
        if names is not None:
            self.names = names
        if not isinstance(message, Assigned) and message.restored is not None:
            self.restored[message.rank] = message.restored

    def settle(self, supervisor: Supervisor, ending: Ending) -> bool:
        self.returned = ending.kind == "returned"
        self.kept = self.returned or self._bring_back(supervisor)
        if self._restoring and len(self.restored) < supervisor.config.nprocs:
            self.restore_failed, self.kept = True, False
        return self.kept

    def told(self, error: BaseException) -> BaseException:
        lost = None if self.kept or self.restore_failed else self._when_lost()
        return with_session_note(error, bool(self.kept), lost)

    def abandoned(self) -> bool:
        if self.kept is not None:
            return False
        self.kept = False
        return True

    def _bring_back(self, supervisor: Supervisor) -> bool:
        """Interrupt the ranks still in the run; True once every rank is back at rest,
        within ``SETTLE_SECONDS`` (which also wait for rank 0's names, sent right after
        its report)."""
        if supervisor.lost:
            return False
        everyone = set(range(supervisor.config.nprocs))
        self._group.interrupt(everyone - supervisor.attempt.reported)
        deadline = time.monotonic() + SETTLE_SECONDS

        def at_rest() -> bool:
            return supervisor.attempt.reported == everyone and not supervisor.lost

        supervisor.pump.run(lambda: at_rest() or supervisor.lost, SETTLE_SECONDS,
                            turn=supervisor.pump_output)
        if at_rest() and self.names is None:
            supervisor.pump.run(lambda: self.names is not None, deadline - time.monotonic())
        return at_rest()
