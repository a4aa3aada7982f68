"""When a run's end prints its summary line (``PanelState.quiet_end``), in each display:
a session's quick run that finishes prints none, as a cell run in the notebook; every
other ending, and every run that showed something, does."""

from __future__ import annotations

import io

import pytest

from nbddp._panel.state import SHOW_AFTER, PanelState
from nbddp._panel.text_panel import TextPanel
from nbddp._panel.widget_panel import WidgetPanel
from nbddp._wire.history import History

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


def ended(status: str = "finished", quiet_when_quick: bool = True, **changes) -> PanelState:
    state = PanelState(2, History(2), where="session · run 3",
                       quiet_when_quick=quiet_when_quick)
    state.status = status
    state.ended = state.started + changes.pop("seconds", 0.01)
    for name, value in changes.items():
        setattr(state, name, value)
    return state


def printed(state: PanelState) -> dict[str, str]:
    """What each display writes as the run ends (where widgets cannot render: text)."""
    said = {}
    for panel_type in (TextPanel, WidgetPanel):
        stream = io.StringIO()
        panel_type(stream).close(state)
        said[panel_type.__name__] = stream.getvalue()
    return said


def test_a_sessions_quick_run_that_finishes_says_nothing():
    assert printed(ended()) == {"TextPanel": "", "WidgetPanel": ""}


@pytest.mark.parametrize("state, why", [
    (ended("failed", message="rank 1 raised ValueError"), "failed"),
    (ended("interrupted", message="every rank was stopped"), "interrupted"),
    (ended("timed out", message="the run did not finish within 1 s"), "timed out"),
    (ended(quiet_when_quick=False), "finished"),  # a launch, or auto mode
    (ended(seconds=SHOW_AFTER + 0.1), "finished"),  # its panel showed
    (ended(position=(5, 5, None)), "5/5"),  # progress
], ids=["failed", "interrupted", "timed-out", "launch-or-auto", "long", "progress"])
def test_every_other_end_says_how_it_ended(state, why):
    for display, text in printed(state).items():
        assert text.startswith("nbddp: ") and why in text, (display, text)


def test_a_quick_run_that_logged_metrics_says_their_mean():
    history = History(2)
    history.add(0, [(0, {"loss": 1.0})])
    history.add(1, [(0, {"loss": 3.0})])
    history.close()
    state = ended(history=history)
    for display, text in printed(state).items():
        assert "rank-averaged loss=2" in text, (display, text)
