"""Where each rank's step time goes, and which rank holds the others back.

Fed by the ranks' ``StepTimes`` (about once a second; totals since the run began). Each
rank's split is taken over its last ``WINDOW`` seconds, so a rank that begins to wait
shows it soon: the share of a step (the wait for its batch included) spent waiting for
data, in collectives (DDP's gradient all-reduce beyond the backward's computation) and
computing (the rest of the step).

In a synchronised job every rank's step lasts as long as the slowest rank's: the fast
ones wait for it in the collectives. The rank that holds the others back is the one that
waits least in collectives; where no collective time is measured, the one that waits
most for data.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import NamedTuple

from ..._wire.rank_stats import StepTimes

WINDOW = 10.0
"""Seconds of a rank's reports its split is measured over."""
PARTS = ("data", "compute", "collectives")
_DOING = {"data": "waiting for data", "compute": "computing",
          "collectives": "waiting in collectives"}


class Split(NamedTuple):
    """Shares of one rank's step time (they add up to 1), and its seconds per step."""

    data: float
    compute: float
    collectives: float
    seconds: float
    collectives_measured: bool

    def share(self, part: str) -> float:
        return float(getattr(self, part))

    def text(self) -> str:
        """``data 61% compute 12% collectives 27% (0.21 s/step)``"""
        parts = [f"{part} {self.share(part):.0%}" for part in PARTS
                 if part != "collectives" or self.collectives_measured]
        return " ".join(parts) + f" ({_seconds(self.seconds)}/step)"


class TimeSplit:
    """Per rank, a window of cumulative step times; their split on demand."""

    def __init__(self) -> None:
        self._reports: dict[int, deque[tuple[float, StepTimes]]] = {}
        self._lock = threading.Lock()  # the supervisor writes, the user's thread reads

    def add(self, times: StepTimes, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            reports = self._reports.setdefault(times.rank, deque())
            reports.append((now, times))
            while len(reports) > 2 and now - reports[1][0] >= WINDOW:
                reports.popleft()  # keep one report at least WINDOW old as the base

    def restart(self) -> None:
        """A new attempt: its ranks count from zero again."""
        with self._lock:
            self._reports.clear()

    def splits(self) -> dict[int, Split]:
        """Each rank's split over its window (ranks without steps yet left out)."""
        with self._lock:
            windows = {rank: (r[0][1], r[-1][1]) for rank, r in self._reports.items()}
        splits = {}
        for rank, (first, last) in windows.items():
            split = _split(first, last) if last.steps - first.steps >= 2 else _split(None, last)
            if split is not None:
                splits[rank] = split
        return splits


def _split(first: StepTimes | None, last: StepTimes) -> Split | None:
    """The split of the steps between two reports (from the run's start, without
    ``first``)."""
    steps = last.steps - (first.steps if first else 0)
    data = last.data_s - (first.data_s if first else 0.0)
    step = last.step_s - (first.step_s if first else 0.0)
    if steps <= 0 or data + step <= 0:
        return None
    comm, measured = _collectives_per_step(first, last)
    per_step = (data + step) / steps
    comm = min(comm, step / steps)
    data_share, comm_share = data / steps / per_step, comm / per_step
    return Split(data_share, max(0.0, 1.0 - data_share - comm_share), comm_share, per_step,
                 measured)


def _collectives_per_step(first: StepTimes | None, last: StepTimes) -> tuple[float, bool]:
    """The mean measured wait in collectives per step: over the window where it has
    samples, else over the run (samples come every tenth step only)."""
    if first is not None and last.comm_samples > first.comm_samples:
        return ((last.comm_s - first.comm_s) / (last.comm_samples - first.comm_samples), True)
    if last.comm_samples:
        return last.comm_s / last.comm_samples, True
    return 0.0, False


def holder(splits: dict[int, Split]) -> str:
    """``rank 3: 61% of its step waiting for data``: the rank the others wait for, and
    its biggest share; "" with fewer than two ranks' splits."""
    if len(splits) < 2:
        return ""
    rank = max(splits, key=lambda r: (1.0 - splits[r].collectives, splits[r].data))
    split = splits[rank]
    shown = [p for p in PARTS if p != "collectives" or split.collectives_measured]
    part = max(shown, key=split.share)
    return f"rank {rank}: {split.share(part):.0%} of its step {_DOING[part]}"


def split_lines(splits: dict[int, Split]) -> list[str]:
    """The panel's text: one line per rank, then who holds the others back."""
    lines = [f"rank {rank}: {split.text()}" for rank, split in sorted(splits.items())]
    verdict = holder(splits)
    return lines + ([f"slowest: {verdict}"] if verdict else [])


def _seconds(value: float) -> str:
    return f"{value * 1000:.3g} ms" if value < 1 else f"{value:.3g} s"
