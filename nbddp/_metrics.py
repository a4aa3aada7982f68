"""``nbddp.log`` and ``nbddp.progress``: metrics and progress from the ranks.

On a rank of a launched run, ``log`` only appends to a buffer (no collective, no
synchronisation, no waiting on the kernel); a background thread sends the buffer to
the kernel about ten times a second, where values are averaged over ranks. Outside a
launched run ``progress`` is a plain tqdm bar and ``log`` does nothing.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from ._channel import Metrics

T = TypeVar("T")
_SEND_INTERVAL = 0.1

_reporter: Reporter | None = None
_script: Any = None  # the ScriptReporter of a script run, once a process group is up


class Reporter:
    """Buffers one rank's metrics and progress and sends them from a thread of its own."""

    def __init__(self, rank: int, send: Callable[[Metrics], None]) -> None:
        self.rank, self._send = rank, send
        self._records: deque[tuple[int, dict[str, Any]]] = deque()
        self._step = -1
        self.position: tuple[int, int | None, str | None] | None = None
        self._sent_position: tuple | None = None
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="nbddp-metrics")
        self._thread.start()

    def log(self, step: int | None, metrics: dict[str, Any]) -> None:
        self._step = self._step + 1 if step is None else step
        for name, value in metrics.items():
            if getattr(value, "requires_grad", False):  # keep no autograd graph alive
                metrics[name] = value.detach()
        self._records.append((self._step, metrics))

    def track(self, iterable: Iterable[T], total: int | None, desc: str | None) -> Iterator[T]:
        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.position = (0, total, desc)
        for done, item in enumerate(iterable, start=1):
            yield item
            self.position = (done, total, desc)

    def _loop(self) -> None:
        while not self._stop.wait(_SEND_INTERVAL):
            self.flush()

    def flush(self) -> None:
        records = []
        while self._records:
            step, metrics = self._records.popleft()
            records.append((step, self._numbers(metrics)))
        position = self.position
        if records or position != self._sent_position:
            self._sent_position = position
            self._send(Metrics(self.rank, records, position))

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
        self.flush()


def log(step: int | None = None, **metrics: Any) -> None:
    """Record metrics (numbers or 0-d tensors) for ``step``; the kernel averages them
    over ranks per step and metric. ``step=None`` counts this rank's calls. Never blocks.

    In a script run (an exported script under torchrun, srun or python) rank 0 prints
    the averages and writes them as JSON lines; outside any run it does nothing."""
    global _script
    if _reporter is not None:
        _reporter.log(step, metrics)
        return
    if _script is None:  # asked again until a process group is up
        from ._script_metrics import script_reporter

        _script = script_reporter()
    if _script is not None:
        _script.log(step, metrics)


def progress(iterable: Iterable[T], total: int | None = None, desc: str | None = None
             ) -> Iterable[T]:
    """Wrap an iterable like tqdm; rank 0's position drives the notebook's progress bar."""
    if _reporter is None:
        from tqdm.auto import tqdm

        rank = int(os.environ.get("RANK", "0"))  # in a script run, only rank 0 shows a bar
        return tqdm(iterable, total=total, desc=desc, disable=rank != 0)
    return _reporter.track(iterable, total, desc)


def start_reporting(rank: int, send: Callable[[Metrics], None]) -> Reporter:
    """Called by the worker: from now on ``log``/``progress`` report to the kernel."""
    global _reporter
    _reporter = Reporter(rank, send)
    return _reporter
