"""The live panel under the cell: ipywidgets, made once there is something to show.

``WidgetPanel`` is the frontend a run gets in a Jupyter kernel: a header, a progress
bar, the latest metrics, charts (``_panel.chart``) and the ranks (``panel_html``). A
quick run's widgets are never made (``SHOW_AFTER``); a closed panel leaves its text
view (``text_panel.text_view``) for a notebook saved headless. ipywidgets is imported
only when the widgets are made.
"""

from __future__ import annotations

import html
import sys
from typing import Any, TextIO

from .chart import charts_html
from .many_ranks import MANY_RANKS
from .panel_html import every_rank_html, header_html, metrics_html, speed_html
from .state import PanelState
from .text_panel import text_view


class WidgetPanel:
    """ipywidgets under the cell: header, progress bar, metrics, charts, ranks. They are
    made once the run has progress or metrics to show, or has lasted ``SHOW_AFTER``."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._widgets: _Widgets | None = None
        self._closed = False

    def _shown(self, state: PanelState) -> _Widgets | None:
        if self._widgets is None and state.worth_a_panel():
            self._widgets = _Widgets()
        return self._widgets

    def refresh(self, state: PanelState) -> None:
        widgets = self._shown(state)
        if widgets is not None:
            widgets.refresh(state)

    def write(self, text: str) -> None:
        self._stream.write(text)
        self._stream.flush()

    def close(self, state: PanelState) -> None:
        self.refresh(state)
        self._closed = True
        self.note(state)
        if not state.quiet_end():
            self._stream.write(state.summary() + "\n")
        if self._widgets is None and state.footer:
            self._stream.write(f"nbddp: {state.footer}\n")
        if not _kernels_own(self._stream):  # (a file of the caller's: its last line now)
            self._stream.flush()
        # The kernel's own stream is not flushed: it sends what was written before it
        # says the cell is done (and within its flush interval otherwise). A flush from
        # this thread waits for its I/O thread, and the caller for this, every cell.

    def note(self, state: PanelState) -> None:
        """The last line, live: standby ranks starting, ready, stopped."""
        if self._widgets is not None:
            self._widgets.note(state, closed=self._closed)

    def draws_ranks(self, state: PanelState) -> bool:
        """Once the widgets are shown (a quick run's never are)."""
        return self._shown(state) is not None


class _Widgets:
    """The panel's widgets, displayed under the cell when made."""

    def __init__(self) -> None:
        try:
            import ipywidgets as w
        except ImportError as exc:  # pragma: no cover - a dependency, but say what to do
            raise ImportError("the live panel needs ipywidgets: pip install ipywidgets") from exc
        from IPython.display import display

        self.header = w.HTML()
        self.bar = w.IntProgress(value=0, min=0, max=1, bar_style="info",
                                 layout=w.Layout(width="60%"))
        self.speed = w.HTML()
        self.metrics = w.HTML()
        self.charts = w.HTML()
        self.footer = w.HTML()
        self.every = w.ToggleButton(description="every rank", value=False,
                                    tooltip="show each rank's state and note",
                                    layout=w.Layout(width="max-content", display="none"))
        self.every_list = w.HTML()
        self._state: PanelState | None = None
        self.every.observe(self._show_every, names="value")
        self.box = w.VBox([self.header, self.every, self.every_list,
                           w.HBox([self.bar, self.speed]), self.metrics, self.charts,
                           self.footer])
        self._handle = display(self._bundle("nbddp: running"), raw=True, display_id=True)

    def _bundle(self, text: str) -> dict[str, Any]:
        """The widget, with the panel as text for places that cannot render widgets
        (a notebook run headless keeps this text)."""
        bundle = dict(self.box._repr_mimebundle_())
        bundle["text/plain"] = text
        return bundle

    def refresh(self, state: PanelState) -> None:
        self.header.value = header_html(state)
        self._state = state
        if len(state.ranks) > MANY_RANKS:
            self.every.layout.display = ""
            self._show_every()
        n, total = (state.position or (0, None, None))[:2]
        self.bar.max = max(total or n or 1, 1)
        self.bar.value = min(n, self.bar.max)
        self.bar.bar_style = {"finished": "success", "running": "info", "queued": "",
                              "requeued": "warning"}.get(state.status, "danger")
        self.speed.value = speed_html(state)
        self.metrics.value = metrics_html(state.history.latest)
        self.charts.value = charts_html(state.history.series)

    def _show_every(self, change: Any = None) -> None:
        """Every rank's chip, with its note, while the toggle is down (worked out then:
        with many ranks the supervisor notes only the ranks the header names)."""
        state = self._state
        if state is None or not self.every.value:
            self.every_list.value = ""
            return
        notes = state.every_note() if state.every_note is not None else state.rank_notes
        self.every_list.value = every_rank_html(state, notes)

    def note(self, state: PanelState, closed: bool) -> None:
        self.footer.value = (f'<small style="color:#666">nbddp: {html.escape(state.footer)}'
                             "</small>" if state.footer else "")
        if closed and self._handle is not None:  # what a notebook saved headless keeps
            self._handle.update(self._bundle(text_view(state)), raw=True)


def _kernels_own(stream: TextIO) -> bool:
    """``stream`` is ipykernel's output stream (which flushes itself)."""
    iostream = sys.modules.get("ipykernel.iostream")
    return iostream is not None and isinstance(stream, iostream.OutStream)
