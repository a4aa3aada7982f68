"""One rank's metrics and progress, buffered and sent from a thread of its own.

``log`` appends to a buffer and returns: no collective, no synchronisation, no waiting
on the kernel. Ten times a second a background thread turns the values into numbers (a
0-d tensor's ``.item()`` happens there, off the training thread) and hands them to
``send``: the kernel's channel in a launched run, a file in a script run. About once a
second it also sends the rank's own stats (``_rank.stats``) and where its steps' time
goes (``_rank.step_clock``), when asked to.

Every rank sends on the same beat of the clock (each tenth of a second of ``time.time``,
which the machines of a cluster share to a few milliseconds): the ranks' reports reach
the kernel (or their node's relay) together, and it wakes for them a few times a beat,
not once per rank at a time of the rank's own (32 ranks logging: the kernel's CPU
about halved).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from .._wire.messages import Metrics
from .._wire.rank_stats import RankStats, StepTimes
from .stats import sample
from .step_clock import StepClock, StepTotals

T = TypeVar("T")
_SEND_INTERVAL = 0.1
_STATS_INTERVAL = 1.0


def until_next_beat(now: float) -> float:
    """Seconds from ``now`` (``time.time()``) to the next send: the next multiple of the
    interval, or the one after if that is too close to tell from the last (a wait may
    end a moment before its beat)."""
    wait = _SEND_INTERVAL - now % _SEND_INTERVAL
    return wait if wait > _SEND_INTERVAL / 10 else wait + _SEND_INTERVAL


class Reporter:
    """Buffers one rank's metrics and progress and sends them from a thread of its own."""

    def __init__(self, rank: int, send: Callable[[Any], None], stats: bool = False) -> None:
        self.rank, self._send, self._stats = rank, send, stats
        self._stop = threading.Event()
        self._sending = threading.Lock()  # one flush at a time: the thread's or a pause's
        self._active = True
        self.clock = StepClock()
        """The loop's steps, timed by ``track`` (or a framework integration)."""
        self._begin()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="nbddp-metrics")
        self._thread.start()

    def _begin(self) -> None:
        """A run's reporting starts from nothing."""
        self._stats_sent = 0.0
        self._records: deque[tuple[int, dict[str, Any], bool]] = deque()
        self._step = -1
        self.position: tuple[int, int | None, str | None] | None = None
        self._sent_position: tuple | None = None
        self._warned = False
        if not self.clock.fresh:  # (a session's quick cells mark no step: one clock
            self.clock = StepClock()  # serves them all)
        self._sent_times = StepTotals()

    def pause(self) -> None:
        """The run ended: send what is left, then nothing until ``resume`` (a session's
        rank keeps its reporter, and its thread, for the next run). No loop goes on past
        its run (a framework's step that raised never said so): the clock stops looking
        for models, and leaves no hook on every module's forward."""
        with self._sending:
            self._active = False
            self._flush_all()
            self.clock.loop_ended()

    def resume(self, send: Callable[[Any], None]) -> None:
        """The next run: report afresh, to ``send``."""
        with self._sending:
            self._send = send
            self._begin()
            self._active = True

    def log(self, step: int | None, metrics: dict[str, Any], for_all: bool = False) -> None:
        """Buffer ``metrics`` for ``step``; ``for_all``: they speak for every rank."""
        self._step = self._step + 1 if step is None else step
        for name, value in metrics.items():
            if getattr(value, "requires_grad", False):  # keep no autograd graph alive
                metrics[name] = value.detach()
        self._records.append((self._step, metrics, for_all))

    def set_position(self, done: int, total: int | None, desc: str | None) -> None:
        """Where the run is, for a loop that ``track`` does not wrap (a framework's)."""
        self.position = (done, total, desc)

    def track(self, iterable: Iterable[T], total: int | None, desc: str | None) -> Iterator[T]:
        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.position = (0, total, desc)
        clock, items, done = self.clock, iter(iterable), 0
        try:
            while True:
                clock.batch_asked()
                try:
                    item = next(items)
                except StopIteration:
                    return
                clock.batch_ready()
                yield item
                done += 1
                self.position = (done, total, desc)
        finally:
            clock.loop_ended()

    def _loop(self) -> None:
        while not self._stop.wait(until_next_beat(time.time())):
            with self._sending:
                if not self._active:
                    continue
                self.flush()
                if self._stats and time.monotonic() - self._stats_sent >= _STATS_INTERVAL:
                    self.send_stats()

    def send_stats(self) -> None:
        """Where this rank is and what it holds, and where its steps' time went."""
        self._stats_sent = time.monotonic()
        self._send(self.sample())
        self.send_step_times()

    def sample(self) -> RankStats:
        """Where this rank is and what it holds (its last step: logged, or its progress)."""
        step = self._step if self._step >= 0 else (self.position or (None,))[0]
        return sample(self.rank, step)

    def send_step_times(self) -> None:
        """Where the steps' time went, if there are new steps."""
        totals = self.clock.totals
        if totals.steps != self._sent_times.steps:
            self._sent_times = totals
            self._send(StepTimes(self.rank, *totals))

    def flush(self) -> None:
        records: list[tuple[int, dict[str, float]]] = []
        for_all: list[tuple[int, dict[str, float]]] = []
        while self._records:
            step, metrics, speaks_for_all = self._records.popleft()
            (for_all if speaks_for_all else records).append((step, self._numbers(metrics)))
        position = self.position
        if records or for_all or position != self._sent_position:
            self._sent_position = position
            self._send(Metrics(self.rank, records, position, for_all))

    def _numbers(self, metrics: dict[str, Any]) -> dict[str, float]:
        numbers = {}
        for name, value in metrics.items():
            try:
                numbers[name] = float(value)  # a 0-d tensor's .item(), off the training thread
            except (TypeError, ValueError, RuntimeError):
                if not self._warned:
                    self._warned = True
                    print(f"nbddp.log: {name}={value!r} is not a number or a 0-d tensor; "
                          "such values are left out", file=sys.stderr)
        return numbers

    def close(self) -> None:
        """Stop the thread and send what is left (before the rank reports its result)."""
        self._stop.set()
        self._thread.join()
        self._flush_all()

    def _flush_all(self) -> None:
        self.flush()
        if self._stats:
            self.send_step_times()
