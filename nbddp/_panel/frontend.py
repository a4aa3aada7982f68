"""Which frontend shows a run: widgets in a notebook, text elsewhere, or nothing.

``make_panel`` is the one place the choice is made (``NBDDP_DISPLAY`` overrides it);
the supervisor gets a ``Panel`` and draws on it whichever it is.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

from .._notebook.kernel import in_notebook_kernel
from .state import Panel, PanelState
from .text_panel import TextPanel
from .widget_panel import WidgetPanel


class QuietPanel:
    """``output="none"``: nothing is shown, not even the summary line (a loop of session
    runs in a script prints nothing); the run's records and ``Job.logs`` keep it all."""

    def refresh(self, state: PanelState) -> None:
        pass

    def write(self, text: str) -> None:
        pass

    def close(self, state: PanelState) -> None:
        pass

    def note(self, state: PanelState) -> None:
        pass

    def draws_ranks(self, state: PanelState) -> bool:
        return False


def make_panel(stream: TextIO | None = None, quiet: bool = False) -> Panel:
    """Widgets inside a Jupyter kernel, text elsewhere, nothing when ``quiet``;
    ``NBDDP_DISPLAY`` chooses between the first two."""
    if quiet:
        return QuietPanel()
    stream = stream or sys.stdout
    choice = os.environ.get("NBDDP_DISPLAY", "auto")
    if choice == "widget" or (choice == "auto" and in_notebook_kernel()):
        return WidgetPanel(stream)
    return TextPanel(stream)
