"""Where a run's ranks are when it stops or looks stalled: their stacks and hang report.

A run that is interrupted or times out ends with an error that says where each rank
still running was, taken before anything stops them (``hang_report.look_at``), and the
records keep it. While a run goes on, one where no rank printed or advanced for
``RunConfig.stall_after`` seconds is said to look stalled, once, with where each rank
is and who waits for whom; the panel names each rank's place until a rank moves again.

This is kept apart from following the run's messages: looking at the ranks asks them
questions over the group, and only these two moments call for it.
"""

from __future__ import annotations

from collections.abc import Callable

from ..._panel.state import PanelState
from ..attempts import Attempt
from ..config import RunConfig
from ..groups.group import RankGroup
from ..records import Records
from .hang_report import look_at
from .stack_view import summary_of, where


class StallWatch:
    """Looks at one run's ranks when it stops or stalls, and says what it saw."""

    def __init__(self, group: RankGroup, config: RunConfig, records: Records,
                 state: PanelState, note_now: Callable[[str], None]) -> None:
        """``state``: the panel's, whose message says the run looks stalled;
        ``note_now``: shows a line of nbddp's own after the ranks' output."""
        self._group, self._records, self._state, self._note_now = group, records, state, note_now
        self._limit = config.stall_after
        self._resting = config.resting_ranks  # a session's ranks the run is not given to
        self._given = config.running_ranks
        self.stalled = False
        self.stalled_at: dict[int, str] = {}
        """Where each rank was when the run stalled (its note, until a rank moves)."""

    def look_at(self, ranks: set[int], starting: set[int]) -> tuple[dict[int, str], str]:
        """``ranks``' stacks and the hang report (``hang_report.look_at``; ``starting``:
        the ranks that have not said hello yet); the report also names the ranks a
        collective in this run waits for in vain, if it was given to some ranks only."""
        stacks, report = look_at(self._group, ranks, starting)
        if self._resting and report:
            who = ", ".join(map(str, self._resting))
            given = ", ".join(map(str, self._given))
            report += (f"\nranks {who} are at rest: this run is on ranks {given} only, so a "
                       "collective in it waits for them forever")
        return stacks, report

    def error_with_stacks(self, kind: type[BaseException], message: str,
                          attempt: Attempt) -> BaseException:
        """``kind(message)``, with where each rank of ``attempt`` still running was
        (``.stacks``) and where each is in its collectives (``.hang_report``), taken
        before anything stops them; both also kept in the records."""
        running = attempt.running
        stacks, report = self.look_at(running, attempt.starting) if running else ({}, "")
        if stacks or report:
            self._records.stacks.write_text(
                "".join(f"--- rank {rank} ---\n{text}\n\n" for rank, text in stacks.items())
                + report + "\n")
            message += ("\n" if message else "") + where(stacks, report)
        error = kind(message) if message else kind()
        error.stacks = stacks  # type: ignore[attr-defined]
        error.hang_report = report  # type: ignore[attr-defined]
        return error

    def check(self, quiet: float, attempt: Attempt) -> None:
        """No rank printed or advanced for ``quiet`` seconds: say once when the run looks
        stalled, and forget it when a rank moves again (not while a rank sits in pdb)."""
        state, limit = self._state, self._limit
        if limit is None or state.status != "running" or "debugging" in state.ranks:
            return
        if quiet >= limit and not self.stalled:
            self.stalled = True
            self._say_stalled(quiet, attempt)
        elif quiet < limit and self.stalled:
            self.stalled = False
            self.stalled_at = {}
            state.message = ""
        state.rank_notes.update(self.stalled_at)

    def _say_stalled(self, quiet: float, attempt: Attempt) -> None:
        """The run looks stalled: say so, where each rank is and who waits for whom (the
        panel names each rank's place until it moves again)."""
        stacks, report = self.look_at(attempt.running, attempt.starting)
        lines = {rank: summary_of(text) for rank, text in stacks.items()}
        self.stalled_at = {rank: line.split(": ", 1)[-1] for rank, line in lines.items()}
        self._state.message = (f"looks stalled: no rank has printed or advanced for "
                               f"{int(quiet)} s")
        at = "".join(f"{line}\n" for _, line in sorted(lines.items()))
        self._note_now(f"nbddp: the run {self._state.message}\n{at}{report}\n"
                       "nbddp: an interrupt stops it and shows each rank's stack "
                       "(job.stacks() and job.hang_report() while it goes on)\n")
