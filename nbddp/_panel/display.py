"""What a user watches while a run trains: one state object, two frontends.

``PanelState`` holds progress, throughput, the latest rank-averaged metrics, each
rank's state and the metric curves. ``WidgetPanel`` draws it with ipywidgets under the
cell (a progress bar, a table, charts of related metrics drawn by ``_panel.chart``);
``TextPanel`` prints the same through tqdm where widgets cannot render. Refreshes are
coalesced by the caller.
"""

from __future__ import annotations

import html
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

from .._notebook.kernel import in_notebook_kernel
from .._wire.history import History, averaged_over
from .chart import best, charts_html, compact, direction
from .many_ranks import MANY_RANKS, counts

_SPLIT_COLORS = (("data", "#ff7f0e"), ("compute", "#1f77b4"), ("collectives", "#9467bd"))
"""The step-time bar's parts, left to right."""
_COLORS = {"starting": "#999", "running": "#1f77b4", "finished": "#2ca02c",
           "failed": "#d62728", "stopped": "#999", "requeueing": "#ff7f0e",
           "debugging": "#9467bd", "resting": "#bbb"}


@dataclass
class PanelState:
    """Everything the panel shows, updated by the supervisor as messages arrive."""

    nprocs: int
    history: History
    log_dir: str = ""
    status: str = "running"
    """queued, requeued, running, finished, failed, cancelled, interrupted or timed out."""
    where: str = ""
    """Where the ranks run when not on this machine, e.g. ``SLURM job 12``."""
    message: str = ""
    footer: str = ""
    """The panel's last line: what the standby ranks for the next launch are doing."""
    ranks: list[str] = field(default_factory=list)
    """Each rank's state as last shown: copied in before each redraw from the one record
    the supervisor keeps of what the ranks reported (the panel only reads it)."""
    rank_notes: dict[int, str] = field(default_factory=dict)
    """Per rank, a few words from its stats (step, speed, memory, "behind")."""
    behind: set[int] = field(default_factory=set)
    """Ranks that fall behind the others."""
    notable: list[tuple[str, int]] = field(default_factory=list)
    """With many ranks: the few the panel names, and why (``_panel.many_ranks``)."""
    every_note: Callable[[], dict[int, str]] | None = None
    """With many ranks: every rank's note, worked out when the user asks to see them."""
    split_bars: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    """Per rank, the shares of its step time waiting for data, computing and waiting in
    collectives (a small stacked bar beside the rank)."""
    split_lines: list[str] = field(default_factory=list)
    """The same in words, and which rank holds the others back (its last line)."""
    position: tuple[int, int | None, str | None] | None = None
    quiet_when_quick: bool = False
    """A session's run (a ``%%ddp`` cell, ``Session.run``; not in auto mode): if it
    finishes quickly with nothing to add, its end prints no summary line (``quiet_end``)."""
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    _progress_started: tuple[float, int] | None = None

    def __post_init__(self) -> None:
        self.ranks = ["starting"] * self.nprocs

    def set_position(self, position: tuple[int, int | None, str | None]) -> None:
        if self._progress_started is None or position[0] < self._progress_started[1]:
            self._progress_started = (time.monotonic(), position[0])
        self.position = position

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    @property
    def rate(self) -> float | None:
        """Rank 0's steps per second since its progress began."""
        if self.position is None or self._progress_started is None:
            return None
        seconds = (self.ended or time.monotonic()) - self._progress_started[0]
        done = self.position[0] - self._progress_started[1]
        return done / seconds if seconds > 0 and done > 0 else None

    @property
    def eta(self) -> float | None:
        if self.position is None or self.position[1] is None or not self.rate:
            return None
        return max(0.0, (self.position[1] - self.position[0]) / self.rate)

    def worth_a_panel(self) -> bool:
        """The run has progress or metrics to show, or has lasted ``SHOW_AFTER``."""
        return (self.position is not None or bool(self.history.latest)
                or self.elapsed >= SHOW_AFTER)

    def quiet_end(self) -> bool:
        """The run ends with nothing to say beyond its own output, where it may: a
        session's cell that finished, with no message, before its panel would show.
        Such a cell shows what the ranks printed and nothing else, as a cell that runs
        in the kernel does; its line was the most of a quick cell's cost to the
        notebook (a message for ipykernel's I/O thread to send and the frontend to take:
        0.6 ms of a 3.4 ms cell's own time, on two cores). Under ``%ddp_session auto
        on`` the line stays: it is then the only sign that the cell ran on the ranks."""
        return (self.quiet_when_quick and self.status == "finished" and not self.message
                and not self.worth_a_panel())

    def summary(self) -> str:
        """One line: the run's status, progress and latest averaged metrics."""
        where = f" ({self.where})" if self.where else ""
        parts = [f"nbddp: {self.status} on {self.nprocs} ranks{where} in "
                 f"{_duration(self.elapsed)}"]
        if self.position is not None:
            n, total, _ = self.position
            parts.append(f"{n}/{total}" if total else f"{n} steps")
        metrics = _metric_text(self.history.latest)
        if metrics:
            parts.append(f"rank-averaged {metrics}")
        if self.message:
            parts.append(self.message)
        return ", ".join(parts)


class Panel(Protocol):
    def refresh(self, state: PanelState) -> None: ...
    def write(self, text: str) -> None: ...
    def close(self, state: PanelState) -> None: ...
    def note(self, state: PanelState) -> None: ...

    def draws_ranks(self, state: PanelState) -> bool:
        """Whether closing with ``state`` draws each rank's note (else the supervisor
        need not work them out)."""


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def _metric_text(row: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in row.items() if k not in ("step", "ranks"))


# --- text ----------------------------------------------------------------------------


class TextPanel:
    """tqdm in a terminal or plain Python: a bar once progress or metrics arrive."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._bar: Any = None
        self._shown: tuple | None = None

    def refresh(self, state: PanelState) -> None:
        shown = (state.position, state.history.latest.get("step"))
        if shown == self._shown or (state.position is None and not state.history.latest):
            return  # nothing new: no redraw (and no falling it/s once progress is done)
        self._shown = shown
        if self._bar is None:
            from tqdm import tqdm

            total = state.position[1] if state.position else None
            desc = state.position[2] if state.position else None
            self._bar = tqdm(total=total, desc=desc or "rank 0", file=self._stream,
                             dynamic_ncols=True, mininterval=0, leave=True)
        if state.position is not None:
            self._bar.total = state.position[1]
            self._bar.n = state.position[0]
        self._bar.set_postfix_str(_metric_text(state.history.latest), refresh=False)
        self._bar.refresh()

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.clear()
            self._stream.write(text)
            self._bar.refresh()
        else:
            self._stream.write(text)
        self._stream.flush()

    def close(self, state: PanelState) -> None:
        if self._bar is not None:
            self.refresh(state)
            self._bar.close()
        if not state.quiet_end():
            self._stream.write(state.summary() + "\n")
        if state.split_lines:
            self._stream.write("nbddp: time per step: " + "; ".join(state.split_lines) + "\n")
        if state.footer:
            self._stream.write(f"nbddp: {state.footer}\n")
        self._stream.flush()

    def note(self, state: PanelState) -> None:
        """A terminal gets the last line once, at close: nothing is printed later."""

    def draws_ranks(self, state: PanelState) -> bool:
        return False  # (the bar and the summary line name no rank)


# --- widgets -------------------------------------------------------------------------


SHOW_AFTER = 0.25
"""Seconds before a run with nothing to show yet gets its panel: a quick cell (a
session's, a warm launch's) shows its output and summary line, not a panel's flash."""


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
        # this thread waits for its I/O thread, and the caller for this: 0.2 ms a cell.

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
        self.header.value = _header_html(state)
        self._state = state
        if len(state.ranks) > MANY_RANKS:
            self.every.layout.display = ""
            self._show_every()
        n, total = (state.position or (0, None, None))[:2]
        self.bar.max = max(total or n or 1, 1)
        self.bar.value = min(n, self.bar.max)
        self.bar.bar_style = {"finished": "success", "running": "info", "queued": "",
                              "requeued": "warning"}.get(state.status, "danger")
        self.speed.value = _speed_html(state)
        self.metrics.value = _metrics_html(state.history.latest)
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


def text_view(state: PanelState) -> str:
    """The panel as plain text: status and ranks, a tqdm meter, the latest averages and
    the best so far of the metrics that have a best (lowest loss, highest accuracy)."""
    if len(state.ranks) > MANY_RANKS:
        named = "".join(f"; {why} {rank} ({state.rank_notes.get(rank) or state.ranks[rank]})"
                        for why, rank in state.notable)
        ranks = f"{len(state.ranks)}: {counts(state.ranks)}{named}"
    else:
        ranks = ", ".join(f"{r} {s}" for r, s in enumerate(state.ranks))
    where = f" {state.where}" if state.where else ""
    lines = [f"nbddp: {state.status}{where} (ranks: {ranks})"
             + (f" - {state.message}" if state.message else "")]
    if state.position is not None:
        from tqdm import tqdm

        n, total, desc = state.position
        lines.append(tqdm.format_meter(n, total, state.elapsed, ncols=80, prefix=desc or "",
                                       rate=state.rate))
    latest = state.history.latest
    if latest:
        lines.append(f"step {latest['step']} ({averaged_over(latest)}): "
                     + _metric_text(latest))
        bests = _best_text(state.history.series)
        if bests:
            lines.append(f"best: {bests}")
    if state.split_lines:
        lines.append("time per step: " + "; ".join(state.split_lines))
    if state.footer:
        lines.append(f"nbddp: {state.footer}")
    return "\n".join(lines)


def _best_text(series: dict[str, list[tuple[int, float]]]) -> str:
    """``loss min 0.31 @ 120, acc max 0.93 @ 118``"""
    tops = {name: best(name, points) for name, points in series.items()}
    return ", ".join(f"{name} {direction(name)} {compact(top[1], 4)} @ {top[0]}"
                     for name, top in tops.items() if top is not None)


def _rank_chip(state: PanelState, rank: int, rank_state: str,
               notes: dict[int, str] | None = None) -> str:
    """``● 1 running (step 12, 3.1 steps/s, 1.2 GB)``; orange when it falls behind."""
    color = "#ff7f0e" if rank in state.behind else _COLORS[rank_state]
    note = (state.rank_notes if notes is None else notes).get(rank)
    words = f"{rank} {rank_state}" + (f" ({note})" if note else "")
    bar = _split_bar(state.split_bars.get(rank))
    return (f'<span title="rank {rank}: {html.escape(words)}" style="color:{color}">'
            f"&#9679; {html.escape(words)}</span>{bar}")


def _split_bar(shares: tuple[float, float, float] | None) -> str:
    """A small bar: the rank's step time waiting for data, computing, in collectives."""
    if shares is None:
        return ""
    named = list(zip(_SPLIT_COLORS, shares, strict=True))
    parts = "".join(
        f'<span style="display:inline-block;height:8px;width:{share * 60:.1f}px;'
        f'background:{color}"></span>' for (_, color), share in named)
    title = ", ".join(f"{name} {share:.0%}" for (name, _), share in named)
    return (f'<span class="nbddp-split" title="step time: {title}" style="display:'
            f'inline-flex;width:60px;margin:0 8px 0 4px;vertical-align:middle;'
            f'background:#eee">{parts}</span>')


def _lines_html(text: str) -> str:
    """``text`` escaped, its line breaks kept (HTML would run its lines together)."""
    return "<br>".join(html.escape(line) for line in text.splitlines())


def _header_html(state: PanelState) -> str:
    color = {"finished": "#2ca02c", "running": "#1f77b4", "queued": "#999",
             "requeued": "#ff7f0e"}.get(state.status, "#d62728")
    message = f" &mdash; {_lines_html(state.message)}" if state.message else ""
    where = f" {html.escape(state.where)}" if state.where else ""
    split = ""
    if state.split_lines:
        legend = " ".join(f'<span style="color:{c}">&#9632;</span> {n}' for n, c in _SPLIT_COLORS)
        split = (f'<br><small>time per step ({legend}): '
                 f'{html.escape(state.split_lines[-1])}</small>')
    return (f'<b style="color:{color}">nbddp: {html.escape(state.status)}</b>{where}{message}'
            f'<br><small>ranks: {_ranks_html(state)}</small>{split}')


def _ranks_html(state: PanelState) -> str:
    """A chip per rank; with many ranks, counts per state and the notable ranks' chips."""
    if len(state.ranks) <= MANY_RANKS:
        return every_rank_html(state)
    named = " ".join(f"{why} {_rank_chip(state, rank, state.ranks[rank])}"
                     for why, rank in state.notable)
    return (f"{len(state.ranks)}: {html.escape(counts(state.ranks))}"
            + (f" &middot; {named}" if named else ""))


def every_rank_html(state: PanelState, notes: dict[int, str] | None = None) -> str:
    """A chip per rank (with ``notes``, those instead of the state's)."""
    return " ".join(_rank_chip(state, r, s, notes) for r, s in enumerate(state.ranks))


def _speed_html(state: PanelState) -> str:
    n, total, desc = state.position or (0, None, None)
    parts = [(f"{html.escape(desc)}: " if desc else "") + (f"{n}/{total}" if total else f"{n}")]
    if state.rate:
        parts.append(f"{state.rate:.2f} it/s")
    parts.append(f"elapsed {_duration(state.elapsed)}")
    if state.eta is not None and state.status == "running":
        parts.append(f"ETA {_duration(state.eta)}")
    return "&nbsp;&nbsp;" + " &middot; ".join(parts)


def _metrics_html(row: dict[str, Any]) -> str:
    if not row:
        return ""
    cells = "".join(f"<td><b>{html.escape(k)}</b> {v:.4g}</td>" for k, v in row.items()
                    if k not in ("step", "ranks"))
    return (f"<table><tr><td>step {row['step']} ({averaged_over(row)})</td>"
            f"{cells}</tr></table>")


def _kernels_own(stream: TextIO) -> bool:
    """``stream`` is ipykernel's output stream (which flushes itself)."""
    iostream = sys.modules.get("ipykernel.iostream")
    return iostream is not None and isinstance(stream, iostream.OutStream)


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
