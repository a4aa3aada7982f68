"""``nbddp.log`` and ``nbddp.progress``: metrics and progress from the ranks.

On a rank of a launched run, ``log`` only appends to a buffer (no collective, no
synchronisation, no waiting on the kernel); a background thread sends the buffer to
the kernel about ten times a second, where values are averaged over ranks. Outside a
launched run ``progress`` is a plain tqdm bar and ``log`` does nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from .._wire.rank_stats import RankStats
from .reporter import Reporter

T = TypeVar("T")

_reporter: Reporter | None = None
_resting: Reporter | None = None  # the last run's, paused: the next run takes it up
_script: Any = None  # the ScriptReporter of a script run, once a process group is up


def log(step: int | None = None, **metrics: Any) -> None:
    """Record metrics (numbers or 0-d tensors) for ``step``; the kernel averages them
    over ranks per step and metric. ``step=None`` counts this rank's calls. Never blocks.

    In a script run (an exported script under torchrun, srun or python) rank 0 prints
    the averages and writes them as JSON lines; outside any run it does nothing."""
    _record(step, metrics, for_all=False)


def log_for_all(step: int | None, metrics: dict[str, Any]) -> None:
    """Like ``log``, for values that speak for every rank (already reduced, or logged on
    the main process only): the kernel shows them at once instead of waiting for the
    other ranks' records of ``step``. For the framework integrations."""
    _record(step, metrics, for_all=True)


def _record(step: int | None, metrics: dict[str, Any], for_all: bool) -> None:
    """To the kernel in a launched run, to files in a script run, else nowhere."""
    global _script
    if _reporter is not None:
        _reporter.log(step, metrics, for_all)
        return
    if _script is None:  # asked again until a process group is up
        from .script_metrics import script_reporter

        _script = script_reporter()
    if _script is not None:
        _script.log(step, metrics, for_all)


def set_progress(done: int, total: int | None, desc: str | None = None) -> None:
    """Move the notebook's progress bar to ``done`` of ``total`` (for a framework's loop,
    which ``progress`` cannot wrap). Does nothing outside a launched run."""
    if _reporter is not None:
        _reporter.set_position(done, total, desc)


def step_begins() -> None:
    """A framework's step begins (its batch is there): for the panel's split of each
    rank's step time. ``progress`` marks its loop's steps by itself."""
    if _reporter is not None:
        _reporter.clock.batch_ready()


def step_ends() -> None:
    """A framework's step has ended: the wait for the next batch begins."""
    if _reporter is not None:
        _reporter.clock.batch_asked()


def steps_paused() -> None:
    """A framework leaves its training steps for a while (to validate, say): that time is
    not counted as waiting for data."""
    if _reporter is not None:
        _reporter.clock.loop_ended()


def progress(iterable: Iterable[T], total: int | None = None, desc: str | None = None
             ) -> Iterable[T]:
    """Wrap an iterable like tqdm; rank 0's position drives the notebook's progress bar."""
    if _reporter is None:
        from tqdm.auto import tqdm

        rank = int(os.environ.get("RANK", "0"))  # in a script run, only rank 0 shows a bar
        return tqdm(iterable, total=total, desc=desc, disable=rank != 0)
    return _reporter.track(iterable, total, desc)


def in_launched_run() -> bool:
    """Is this a rank of a run launched from a notebook (``log`` reaches a kernel)?"""
    return _reporter is not None


def start_reporting(rank: int, send: Callable[[Any], None]) -> Reporter:
    """Called by the worker: from now on ``log``/``progress`` report to the kernel, and
    the rank's stats (memory, step) go with them about once a second, the first a tenth
    of a second in (a session's quick cell sends none: its report carries them, see
    ``stop_reporting``). A rank that ran before (a session's) takes up its reporter
    again: no new thread per run."""
    global _reporter, _resting
    if _resting is not None and _resting.rank == rank:
        _reporter, _resting = _resting, None
        _reporter.resume(send)
    else:
        _reporter = Reporter(rank, send, stats=True)
    return _reporter


def stop_reporting() -> RankStats | None:
    """Called by the worker after a run: send what is left; ``log`` reports no more.
    The rank's stats as the run ends, for its report."""
    global _reporter, _resting
    stats = None
    if _reporter is not None:
        _reporter.pause()
        stats = _reporter.sample()
        _resting = _reporter
    _reporter = None
    return stats
