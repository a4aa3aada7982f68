"""What the user watches of one run: its panel's state, kept up to date and closed.

The supervisor's handlers feed the rank view, the time split and the metrics history as
messages come; this reads them into the panel's state (each rank's state and note, the
stragglers, where step time goes), and redraws the panel now and then, not on every
event: between the reports of a quick run's ranks, each look would be on the way to its
end. At the run's end it says the last word, and works out the ranks' final notes only
when someone looks (a quick cell's panel never shows them).

Nothing here refers back to the supervisor, so what the panel keeps (a way to every
rank's note, with many ranks) does not keep the run's objects in a cycle.
"""

from __future__ import annotations

import time

from .._panel.many_ranks import MANY_RANKS, notable
from .._panel.state import Panel, PanelState
from .._wire.history import History
from .attempts import Attempt
from .config import RunConfig
from .diagnosis.rank_view import RankView
from .diagnosis.stall_watch import StallWatch
from .diagnosis.time_split import TimeSplit, split_lines
from .run_output import RunOutput

_REFRESH_INTERVAL = 0.1  # the panel redraws at most ten times a second
_OUTPUT_INTERVAL = 0.05  # the ranks' logs are read at most twenty times a second


class RunPanel:
    """One run's panel state, refreshed from what its ranks reported, and its last word."""

    def __init__(self, config: RunConfig, state: PanelState, panel: Panel, output: RunOutput,
                 stall: StallWatch, view: RankView, split: TimeSplit,
                 history: History) -> None:
        self.state, self.panel, self.output, self._stall = state, panel, output, stall
        self._view, self._split, self._history = view, split, history
        self._nprocs = config.nprocs
        self._resting = config.resting_ranks  # a session's ranks the run is not given to
        self.ended = False
        """The run is over: ranks that were still running were stopped."""
        self._notes_due: Attempt | None = None  # (see ``_final_notes``)
        # The clocks start now: a quick run's first look is its last, in ``close``.
        self._refreshed = self._pumped = time.monotonic()

    def rank_states(self, attempt: Attempt) -> list[str]:
        """Each rank's state now (see ``_run.attempts``); ``resting`` for a session's rank
        the run was not given to."""
        states = attempt.states(self.ended)
        for rank in self._resting:
            states[rank] = "resting"
        return states

    def refresh_now_and_then(self, attempt: Attempt) -> None:
        """Show the ranks' new output every ``_OUTPUT_INTERVAL`` and redraw the panel
        every ``_REFRESH_INTERVAL`` (redraws coalesce), not on every event."""
        now = time.monotonic()
        if now - self._pumped >= _OUTPUT_INTERVAL:
            self.output.pump()
            self._pumped = now
        if now - self._refreshed >= _REFRESH_INTERVAL:
            self._history.tick()
            self._update_view(attempt)
            self.panel.refresh(self.state)
            self._refreshed = time.monotonic()

    def restarted(self, attempt: Attempt, message: str, line: str) -> None:
        """The ranks start again as ``attempt``: what the last one said is over; say why."""
        self._view.restart()
        self._split.restart()
        self.state.message = message
        self.output.note_now(line)
        self.state.ranks = self.rank_states(attempt)
        self.panel.refresh(self.state)

    def _update_view(self, attempt: Attempt) -> None:
        """The panel's rank states, notes and stragglers; say when the run looks stalled."""
        self._note_ranks(attempt)
        self._update_split()
        self._stall.check(self._view.quiet_for(), attempt)

    def _note_ranks(self, attempt: Attempt) -> None:
        """Each rank's state, and its note (step, speed, memory, node) as of its last
        report: at the run's end, its final one. With many ranks, the notes of the few
        the panel names (``_panel.many_ranks``), unless the user asked for every rank."""
        state, view = self.state, self._view
        states = state.ranks = self.rank_states(attempt)
        rates = view.rates()
        state.behind = {r for r in view.behind(rates) if states[r] == "running"}
        only = None
        if self._nprocs > MANY_RANKS:
            reported = [failure.rank for failure in attempt.failures]
            state.notable = notable(states, reported, state.behind, rates)
            only = {rank for _, rank in state.notable}
            state.every_note = lambda: _notes(view, states, rates)
        state.rank_notes = _notes(view, states, rates, only)

    def _update_split(self) -> None:
        splits = self._split.splits()
        self.state.split_bars = {r: (s.data, s.compute, s.collectives)
                                 for r, s in splits.items()}
        self.state.split_lines = split_lines(splits)

    def close(self, attempt: Attempt, status: str, message: str) -> None:
        """The run's last word: the last of the ranks' output, the rest of the history
        averaged, and the panel's final state (ranks still running were stopped)."""
        self.output.close()
        self._history.close()
        self.ended = True
        self.state.ended = time.monotonic()
        self.state.status, self.state.message = status, message
        self._notes_due = attempt  # (the notes of the last refresh may be a second old)
        if self.panel.draws_ranks(self.state):
            self._final_notes()
        self._update_split()
        self.panel.close(self.state)

    def _final_notes(self) -> None:
        """The ranks' notes as the run ended, once: worked out when the panel draws the
        ranks, or when ``Job.state`` is asked (a quick cell's panel never shows them)."""
        attempt, self._notes_due = self._notes_due, None
        if attempt is not None:
            self._note_ranks(attempt)
            self.state.rank_notes.update(self._stall.stalled_at)  # (where a stalled run was)

    @property
    def shown_state(self) -> PanelState:
        """The panel's state, with the ranks' final notes once the run is over."""
        self._final_notes()
        return self.state

    def note(self, line: str) -> None:
        """Set the panel's last line (it may already be closed)."""
        self.state.footer = line
        self.panel.note(self.state)


def _notes(view: RankView, states: list[str], rates: dict[int, float | None],
           only: set[int] | None = None) -> dict[int, str]:
    """Each rank's note (``only`` those ranks')."""
    several_nodes = len(view.hosts) > 1
    return {r: view.summary(info, several_nodes)
            for r, info in view.ranks(states, only, rates).items()}
