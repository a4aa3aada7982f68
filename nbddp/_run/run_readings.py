"""What a user reads of a run, live and after it: the panel's state, each rank's logs,
metrics history, stacks, collectives and state, and the restarts and requeues it went
through. ``Job`` is these readings plus the run's start and end (``_run.job``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._panel.state import PanelState
from .._wire.history import read_history
from .config import RunConfig
from .diagnosis.hang_report import ask_for_report
from .groups.group import RankGroup
from .records import Records
from .supervisor import Supervisor


class RunReadings:
    """A run's readings, from its supervisor, its group and its records."""

    config: RunConfig
    _supervisor: Supervisor
    _group: RankGroup
    _records: Records

    def done(self) -> bool:
        """True once the run has ended and everything it started is gone (``Job``'s)."""
        raise NotImplementedError

    @property
    def state(self) -> PanelState:
        """What the live panel shows now: status, each rank's state, progress, metrics."""
        return self._supervisor.shown_state

    @property
    def logs(self) -> dict[int, str]:
        """Every rank's output so far, by rank, read from the run's records folder."""
        return self._records.read_logs(self.config.nprocs)

    @property
    def records(self) -> Path:
        """The folder that keeps this run's full per-rank logs and metrics history."""
        return self._records.path

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every step's rank-averaged metrics so far: dicts with ``step``, ``ranks`` and
        each metric (read from the run's records, so complete however long the run)."""
        return read_history(self._records.metrics)

    def stacks(self, full: bool = False) -> dict[int, str]:
        """``{rank: text}``: every running rank's Python stacks, taken while the run goes
        on, e.g. to see where a run hangs. Each reads like a traceback: a summary line
        (``rank 0: waiting in barrier (Cell In[3], line 9)``), then the main thread, most
        recent call last, with source lines, then the user's other threads. torch's
        internals are folded and nbddp's frames and threads left out, unless ``full``.
        A SLURM job's ranks answer over the channel, where they reach the kernel. Empty
        once the ranks are gone."""
        return self._group.stacks(full=full)

    def hang_report(self) -> str:
        """Where each running rank is in its collectives, from torch's flight recorder:
        the last one it completed and the one it waits in, numbered per process group,
        and which ranks a waiting collective still waits for (``rank 0 waits in
        all_reduce #12`` / ``rank 1 has completed #11 and is not in a collective``).
        With ``stacks()``, what to read when a run hangs."""
        if self.done():
            return "the run has ended: no rank is in a collective"
        if not self._group.can_ask:
            return ("the kernel cannot ask these ranks: they have no channel to it (they "
                    "report through files)")
        return ask_for_report(self._group, self._supervisor.running, self._supervisor.starting)

    @property
    def restarts(self) -> int:
        """How many times torchrun has restarted every rank in this run (``max_restarts``)."""
        return self._supervisor.attempt.number

    @property
    def ranks(self) -> dict[int, dict[str, Any]]:
        """``{rank: {...}}``, live and after the run: ``state``, ``step`` (its last step
        logged, or its progress), ``steps_per_s``, ``rss_mb``, ``gpu_mem_mb`` (None without
        CUDA), ``pid``, ``host``, ``behind`` (its step trails the others'), and
        ``step_split``: the shares of its step time spent waiting for ``data``,
        ``compute``-ing and waiting in ``collectives``, with its ``seconds`` per step,
        over its last ten seconds (None before its steps are timed)."""
        supervisor = self._supervisor
        ranks = supervisor.view.ranks(supervisor.rank_states())
        splits = supervisor.split.splits()
        for rank, info in ranks.items():
            split = splits.get(rank)
            info["step_split"] = None if split is None else {
                "data": split.data, "compute": split.compute,
                "collectives": split.collectives if split.collectives_measured else None,
                "seconds": split.seconds}
        return ranks

    @property
    def requeues(self) -> int:
        """How many times SLURM has requeued this run's job (each runs it again)."""
        return self._supervisor.attempt.requeue
