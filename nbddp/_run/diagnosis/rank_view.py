"""The kernel's view of each rank while a run goes on: its state, step, speed, memory,
where it runs; which rank falls behind; and whether the run still moves at all.

Fed by the ranks' ``RankStats`` (about once a second) and the supervisor's rank states.
Speeds are measured over the last few seconds, so a rank that slows down shows it soon.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

from ..._wire.rank_stats import RankStats, StatsColumns

_RATE_WINDOW = 10.0  # seconds of step samples a speed is measured over
_BEHIND_SECONDS = 2.0  # behind: the leader is this many seconds (at the median speed) ahead
_BEHIND_MIN_STEPS = 2
_LOOKED_UP = 64  # ranks whose stats are looked up, not every rank's made


class RankView:
    """Per rank: the latest stats and a few seconds of (time, step) samples."""

    def __init__(self, nprocs: int) -> None:
        self.nprocs = nprocs
        self._stats: dict[int, RankStats] = {}
        self._final: list[StatsColumns] = []
        """Ranks' stats as their run ended, not yet in ``_stats``: made into each rank's
        where they are looked at (most quick runs of many ranks are not)."""
        self._steps: defaultdict[int, deque[tuple[float, int]]] = defaultdict(deque)
        """Per rank that reported a step: its samples (made as ranks report: a run of
        thousands of ranks that log nothing makes none)."""
        self.last_activity = time.monotonic()
        """When a rank last started, wrote output or advanced its step."""
        self.running = False
        """A rank has begun the user's code (its first stats came): start-up is no stall."""
        self.hosts: set[str] = set()
        """The nodes the ranks said they run on (several: the panel names each rank's)."""
        self._lock = threading.RLock()  # the supervisor writes, the user's thread reads

    def add(self, stats: RankStats, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.running = True
            self._take_final()
            before = self._stats.get(stats.rank)
            if before is None or (stats.step, stats.output_bytes) != (before.step,
                                                                      before.output_bytes):
                self.last_activity = now
            self._stats[stats.rank] = stats
            self.hosts.add(stats.host)
            self._sample(stats, now)

    def _sample(self, stats: RankStats, now: float) -> None:
        """(Under the lock) ``stats``' step, among the rank's samples of the last seconds."""
        if stats.step is None:
            return
        samples = self._steps[stats.rank]
        samples.append((now, stats.step))
        while samples and now - samples[0][0] > _RATE_WINDOW:
            samples.popleft()

    def add_final(self, final: StatsColumns, now: float | None = None) -> None:
        """Ranks' stats as their run ended (a node's, reported together): ``add`` in bulk,
        for many ranks at once; each rank's is made where it is looked at."""
        if not final.rank:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            self.running = True
            self.last_activity = now  # (a rank that ended moved)
            self._final.append(final)
            self.hosts.update(final.host)
            if final.step.count(None) < len(final.step):  # (a rank reported a step)
                for stats in final.rows():
                    self._sample(stats, now)

    def _stats_of(self, ranks: Sequence[int]) -> dict[int, RankStats]:
        """(Under the lock) ``ranks``' latest stats: a few ranks' looked up among those
        of ranks that ended (the panel's notes of the ranks it names), every rank's made."""
        if len(ranks) > _LOOKED_UP:
            self._take_final()
            return self._stats
        found = {}
        for rank in ranks:
            for final in reversed(self._final):  # (the latest first)
                if rank in final.rank:
                    at = final.rank.index(rank)
                    found[rank] = RankStats._make(column[at] for column in final)
                    break
            else:
                if rank in self._stats:
                    found[rank] = self._stats[rank]
        return found

    def _take_final(self) -> None:
        """(Under the lock) The stats of ranks that ended, each rank's made now."""
        for final in self._final:
            self._stats.update(zip(final.rank, final.rows(), strict=True))
        self._final.clear()

    def touch(self) -> None:
        """Something moved (a rank started, the job began to run): not stalled."""
        self.last_activity = time.monotonic()

    def restart(self) -> None:
        """A new attempt (or a requeued job's next run): speeds start again, and its
        start-up is no stall either."""
        with self._lock:
            self.running = False
            self._stats.clear()
            self._final.clear()
            for samples in self._steps.values():
                samples.clear()
        self.touch()

    def quiet_for(self, now: float | None = None) -> float:
        """Seconds since any rank wrote output or advanced (0 until the code runs)."""
        if not self.running:
            return 0.0
        return (time.monotonic() if now is None else now) - self.last_activity

    def steps_per_s(self, rank: int) -> float | None:
        samples = list(self._steps.get(rank, ()))
        if len(samples) < 2 or samples[-1][0] <= samples[0][0]:
            return None
        return (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0])

    def behind(self, rates: dict[int, float | None] | None = None) -> set[int]:
        """Ranks whose step trails the leading rank's by more than a couple of seconds'
        worth of steps (at the ranks' median speed; ``rates``, if already measured)."""
        if rates is None:
            rates = {r: self.steps_per_s(r) for r in range(self.nprocs)}
        if not any(rates.values()):
            return set()  # (no rank has a speed yet: nobody is behind; no look at each)
        with self._lock:
            self._take_final()
            steps = {r: s.step for r, s in self._stats.items() if s.step is not None}
        speeds = [rate for r in steps if (rate := rates.get(r))]
        if len(steps) < 2 or not speeds:
            return set()
        lead = max(steps.values())
        allowed = max(_BEHIND_MIN_STEPS, _BEHIND_SECONDS * statistics.median(speeds))
        return {r for r, step in steps.items() if lead - step > allowed}

    def rates(self) -> dict[int, float | None]:
        """Each rank's steps per second, where it has two samples or more."""
        with self._lock:
            return self._rates()

    def _rates(self) -> dict[int, float | None]:
        return {rank: self.steps_per_s(rank) for rank, samples in self._steps.items()
                if len(samples) >= 2}

    def ranks(self, states: list[str], only: set[int] | None = None,
              rates: dict[int, float | None] | None = None) -> dict[int, dict[str, Any]]:
        """``{rank: {state, step, steps_per_s, rss_mb, gpu_mem_mb, pid, host, behind}}``,
        for every rank or ``only`` those (``rates``: ``rates()``, if already read)."""
        with self._lock:
            return self._ranks(states, self._rates() if rates is None else rates,
                               range(self.nprocs) if only is None else sorted(only))

    def _ranks(self, states: list[str], rates: dict[int, float | None],
               ranks: Any) -> dict[int, dict[str, Any]]:
        behind = self.behind(rates)
        found = self._stats_of(ranks)
        view = {}
        for rank in ranks:
            stats, rate = found.get(rank), rates.get(rank)
            view[rank] = {
                "state": states[rank],
                "step": stats.step if stats else None,
                "steps_per_s": round(rate, 3) if rate is not None else None,
                "rss_mb": round(stats.rss_mb, 1) if stats and stats.rss_mb is not None
                else None,
                "gpu_mem_mb": round(stats.gpu_mem_mb, 1)
                if stats and stats.gpu_mem_mb is not None else None,
                "pid": stats.pid if stats else None,
                "host": stats.host if stats else None,
                "behind": rank in behind and states[rank] == "running",
            }
        return view

    @staticmethod
    def summary(info: dict[str, Any], with_host: bool = False) -> str:
        """A few words for the panel: ``step 12, 3.1 steps/s, 1.2 GB``; ``with_host``
        (ranks on several nodes) starts with the rank's node: ``on node-a, step 12``."""
        parts = [f"on {info['host']}"] if with_host and info["host"] else []
        if info["step"] is not None:
            parts.append(f"step {info['step']}")
        if info["steps_per_s"]:
            parts.append(f"{info['steps_per_s']:.3g} steps/s")
        memory = info["gpu_mem_mb"] if info["gpu_mem_mb"] is not None else info["rss_mb"]
        if memory is not None:
            where = "GPU " if info["gpu_mem_mb"] is not None else ""
            parts.append(f"{where}{memory / 1024:.1f} GB")
        if info["behind"]:
            parts.append("behind")
        return ", ".join(parts)
