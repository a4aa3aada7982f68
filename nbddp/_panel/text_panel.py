"""The panel as text: tqdm in a terminal or plain Python, and the panel's text view.

Where widgets cannot render, ``TextPanel`` draws a tqdm bar once progress or metrics
arrive and prints the summary line at the end. ``text_view`` is the whole panel as
plain text: what a notebook saved headless keeps of the widget panel
(``widget_panel``).
"""

from __future__ import annotations

from typing import Any, TextIO

from .._wire.history import averaged_over
from .chart import best, compact, direction
from .many_ranks import MANY_RANKS, counts
from .state import PanelState, metric_text


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
        self._bar.set_postfix_str(metric_text(state.history.latest), refresh=False)
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
                     + metric_text(latest))
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
