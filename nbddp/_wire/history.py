"""Rank-averaged metrics per step, in the kernel: exact on disk, bounded in memory.

A step's average is taken once every rank has reported that step, or once it has
waited ``STALE_SECONDS`` while some rank has moved past it: a rank far behind, or one
that never logs, is then left out of that step (``ranks`` says how many were averaged),
and its late records for that step are dropped rather than averaged a second time.
A rank that reports a step it was already part of (its step counter started over) starts
a new row. A record logged "for all ranks" (a value already reduced, or a framework that
logs on its main process only) completes its step at once. Steps are averaged in order.
Every averaged step is appended to a JSON-lines file; memory keeps at most
``MAX_POINTS`` points per metric for the live chart, thinning old ones by half.

Records come one rank's at a time, or, from a node's relay, as the node's sum and count
per step and metric (``add_reduced``): the mean is the same, and the kernel's work grows
with nodes, not ranks.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import IO, Any

STALE_SECONDS = 2.0
MAX_POINTS = 1000  # even, so thinning by half keeps the newest point
_RECENT = 10_000  # averaged steps remembered, to recognise late records


Partial = tuple[int, tuple[int, ...], dict[str, tuple[float, int]]]
"""A node's records of one step, reduced by its relay: the step, the ranks whose records
it holds, and per metric the sum of their values and how many there were."""


class _Pending:
    """A step's records so far: each rank's own values, and nodes' sums."""

    __slots__ = ("ranks", "values", "sums")

    def __init__(self) -> None:
        self.ranks: set[int] = set()  # every rank heard for this step
        self.values: dict[str, dict[int, float]] = {}  # name -> rank -> value
        self.sums: dict[str, list[float]] = {}  # name -> [sum, count]: nodes' sums

    def mean(self, name: str) -> float:
        values, (total, count) = self.values.get(name, {}), self.sums.get(name, (0.0, 0))
        return (sum(values.values()) + total) / (len(values) + count)

    def names(self) -> list[str]:
        return list(dict.fromkeys([*self.values, *self.sums]))


class History:
    """Collects ranks' ``log`` records and turns them into one averaged row per step."""

    def __init__(self, nprocs: int, path: Path | None = None) -> None:
        self.nprocs, self.path = nprocs, path
        self._pending: dict[int, _Pending] = {}
        self._first_seen: dict[int, float] = {}
        self._for_all: set[int] = set()  # pending steps that a for-all record completes
        self._latest_step: dict[int, int] = {}
        self._averaged: OrderedDict[int, frozenset[int]] = OrderedDict()  # step -> its ranks
        self._highest: int | None = None  # for late records of steps no longer remembered
        self.late_records = 0
        """Records that arrived after their step was averaged without them (dropped)."""
        self._file: IO[str] | None = None  # opened with the first row (most quick runs
        # of a session log nothing: no file for them)
        self.latest: dict[str, Any] = {}
        """The last averaged row: ``step``, ``ranks`` and every metric."""
        self.series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        """Per metric, (step, average) points for the chart, at most MAX_POINTS."""

    def add(self, rank: int, records: list[tuple[int, dict[str, float]]],
            for_all: bool = False) -> None:
        """``rank``'s records; ``for_all``: each speaks for every rank (no waiting)."""
        if not records:
            return  # (most batches carry no for-all records: nothing to settle)
        now = time.monotonic()
        for step, metrics in records:
            pending = self._pending_for(step, (rank,), for_all, now)
            if pending is None:
                continue
            for name, value in metrics.items():
                pending.values.setdefault(name, {})[rank] = value
        self._settle(now)

    def add_reduced(self, partials: list[Partial]) -> None:
        """Nodes' records, each already summed over the node's ranks (by its relay): the
        mean stays exact. A node's sum for a step and metric that holds a rank already
        counted there (it logged the same step twice, a moment apart) is dropped."""
        now = time.monotonic()
        for step, ranks, sums in partials:
            pending = self._pending_for(step, ranks, False, now)
            if pending is None:
                continue
            for name, (total, count) in sums.items():
                counted = pending.values.get(name)
                if counted and not counted.keys().isdisjoint(ranks):
                    self.late_records += count
                    continue
                into = pending.sums.setdefault(name, [0.0, 0])
                into[0] += total
                into[1] += count
        self._settle(now)

    def _pending_for(self, step: int, ranks: tuple[int, ...], for_all: bool, now: float
                     ) -> _Pending | None:
        """Where ``ranks``' records of ``step`` go; None if they are late (dropped)."""
        if step not in self._pending and self._late(ranks, step):
            self.late_records += len(ranks)
            return None
        if for_all:
            self._for_all.add(step)
        pending = self._pending.get(step)
        if pending is None:
            pending = self._pending[step] = _Pending()
            self._first_seen.setdefault(step, now)
        pending.ranks.update(ranks)
        latest = self._latest_step
        for rank in ranks:
            if step > latest.get(rank, step - 1):
                latest[rank] = step
        return pending

    def _late(self, ranks: tuple[int, ...], step: int) -> bool:
        """Was ``step`` already averaged without these ranks? (Not: they started over.)"""
        if step in self._averaged:
            return not self._averaged[step].issuperset(ranks)
        latest = self._latest_step
        moving_on = all(step >= latest.get(rank, step) for rank in ranks)
        return moving_on and self._highest is not None and step <= self._highest

    def _settle(self, now: float, everything: bool = False) -> None:
        newest = max(self._latest_step.values(), default=None)
        for step in sorted(self._pending):
            reported = self._pending[step].ranks
            complete = len(reported) == self.nprocs or step in self._for_all
            stale = now - self._first_seen[step] > STALE_SECONDS and newest is not None \
                and newest > step
            if not (complete or stale or everything):
                break  # in order: a later step waits for this one
            self._finish(step, self._pending.pop(step))
            del self._first_seen[step]
            self._for_all.discard(step)

    def _finish(self, step: int, pending: _Pending) -> None:
        row: dict[str, Any] = {"step": step, "ranks": len(pending.ranks)}
        self._averaged[step] = frozenset(pending.ranks)
        self._highest = step if self._highest is None else max(self._highest, step)
        self._averaged.move_to_end(step)
        if len(self._averaged) > _RECENT:
            self._averaged.popitem(last=False)
        for name in pending.names():
            row[name] = pending.mean(name)
            self._append_point(name, step, row[name])
        self.latest = row
        if self._file is None and self.path is not None:
            self._file = self.path.open("a", buffering=1)
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")

    def _append_point(self, name: str, step: int, value: float) -> None:
        points = self.series[name]
        points.append((step, value))
        if len(points) > MAX_POINTS:
            points[:] = points[::2]

    def tick(self) -> None:
        """Average steps that waited long enough (called while the run goes on)."""
        self._settle(time.monotonic())

    def close(self) -> None:
        """Average whatever is left and close the file."""
        self._settle(time.monotonic(), everything=True)
        if self._file is not None:
            self._file.close()
            self._file = None


def averaged_over(row: dict[str, Any]) -> str:
    """How a row's values were made, for the panel: "mean of 2 ranks", or "1 rank"."""
    ranks = row["ranks"]
    return f"mean of {ranks} ranks" if ranks > 1 else f"{ranks} rank"


def read_history(path: Path) -> list[dict[str, Any]]:
    """Every averaged step of a run, in order, from its JSON-lines file."""
    try:
        with path.open() as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
