"""What the panel shows, as one state object, and what every frontend offers.

``PanelState`` holds a run's progress, throughput, the latest rank-averaged metrics,
each rank's state and the metric curves; the supervisor updates it as messages arrive,
and the frontends only read it: widgets under the cell (``widget_panel``), tqdm in a
terminal (``text_panel``), or nothing (``frontend``). ``Panel`` is what the supervisor
calls on whichever it was given. Refreshes are coalesced by the caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._wire.history import History

SHOW_AFTER = 0.25
"""Seconds before a run with nothing to show yet gets its panel: a quick cell (a
session's, a warm launch's) shows its output and summary line, not a panel's flash."""


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
        notebook (a message for ipykernel's I/O thread to send and the frontend to
        take). Under ``%ddp_session auto
        on`` the line stays: it is then the only sign that the cell ran on the ranks."""
        return (self.quiet_when_quick and self.status == "finished" and not self.message
                and not self.worth_a_panel())

    def summary(self) -> str:
        """One line: the run's status, progress and latest averaged metrics."""
        where = f" ({self.where})" if self.where else ""
        parts = [f"nbddp: {self.status} on {self.nprocs} ranks{where} in "
                 f"{duration(self.elapsed)}"]
        if self.position is not None:
            n, total, _ = self.position
            parts.append(f"{n}/{total}" if total else f"{n} steps")
        metrics = metric_text(self.history.latest)
        if metrics:
            parts.append(f"rank-averaged {metrics}")
        if self.message:
            parts.append(self.message)
        return ", ".join(parts)


class Panel(Protocol):
    """A frontend, as the supervisor draws on it: widgets, text, or nothing."""

    def refresh(self, state: PanelState) -> None: ...
    def write(self, text: str) -> None: ...
    def close(self, state: PanelState) -> None: ...
    def note(self, state: PanelState) -> None: ...

    def draws_ranks(self, state: PanelState) -> bool:
        """Whether closing with ``state`` draws each rank's note (else the supervisor
        need not work them out)."""


def duration(seconds: float) -> str:
    """``mm:ss``, or ``h:mm:ss`` from an hour."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def metric_text(row: dict[str, Any]) -> str:
    """``loss=0.31 acc=0.93``: a row of metrics, without its step and rank count."""
    return " ".join(f"{k}={v:.4g}" for k, v in row.items() if k not in ("step", "ranks"))
