"""The live panel's parts as HTML: header, rank chips, step-time bars, speed, metrics.

The widget panel (``widget_panel``) sets these strings as its widgets' values at each
refresh. Pure functions of a ``PanelState``, apart from the widgets, so that what a
panel says is tested without a notebook.
"""

from __future__ import annotations

import html
from typing import Any

from .._wire.history import averaged_over
from .many_ranks import MANY_RANKS, counts
from .state import PanelState, duration

_SPLIT_COLORS = (("data", "#ff7f0e"), ("compute", "#1f77b4"), ("collectives", "#9467bd"))
"""The step-time bar's parts, left to right."""
_COLORS = {"starting": "#999", "running": "#1f77b4", "finished": "#2ca02c",
           "failed": "#d62728", "stopped": "#999", "requeueing": "#ff7f0e",
           "debugging": "#9467bd", "resting": "#bbb"}


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


def header_html(state: PanelState) -> str:
    """The run's status and where it runs, its message, its ranks, and the step time."""
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


def speed_html(state: PanelState) -> str:
    """Beside the bar: rank 0's progress, its steps per second, elapsed time and ETA."""
    n, total, desc = state.position or (0, None, None)
    parts = [(f"{html.escape(desc)}: " if desc else "") + (f"{n}/{total}" if total else f"{n}")]
    if state.rate:
        parts.append(f"{state.rate:.2f} it/s")
    parts.append(f"elapsed {duration(state.elapsed)}")
    if state.eta is not None and state.status == "running":
        parts.append(f"ETA {duration(state.eta)}")
    return "&nbsp;&nbsp;" + " &middot; ".join(parts)


def metrics_html(row: dict[str, Any]) -> str:
    """The latest rank-averaged metrics, as a one-row table."""
    if not row:
        return ""
    cells = "".join(f"<td><b>{html.escape(k)}</b> {v:.4g}</td>" for k, v in row.items()
                    if k not in ("step", "ranks"))
    return (f"<table><tr><td>step {row['step']} ({averaged_over(row)})</td>"
            f"{cells}</tr></table>")
