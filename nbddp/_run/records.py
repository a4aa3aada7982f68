"""Where a run's records stay after it ends: every rank's full log and the metrics history.

A rank group's temporary run dir (payload, key, socket) is removed when its run ends;
the run's records are kept on purpose, like torchrun's ``--log-dir``, so a failure or a
flood of output can be read in full later. They go to ``$NBDDP_RUNS_DIR`` (default
``~/.cache/nbddp/runs``), one private folder per run; the newest ``KEEP_RUNS`` are kept
(looked at every ``PRUNE_EVERY`` runs).
A SLURM job's folder is also its run dir: while its payload is there the job may still be
running (or waiting to be re-attached), so it is never pruned.

The names of the files a rank writes (its log) or shares with the run dir are
``_wire.rundir``'s; the records' own names are spelled here.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path

from .._wire.rundir import KEY, LAUNCHER_LOG, METRICS, PAYLOAD, rank_log_name

KEEP_RUNS = 20
PRUNE_EVERY = 10
"""This process looks for folders beyond ``KEEP_RUNS`` at its first run and every tenth
after (so up to ``KEEP_RUNS + PRUNE_EVERY`` may be kept for a while)."""
_created = 0
LOG_TAIL_BYTES = 64 * 2**20
_PREFIX = "run-"
STACKS = "stacks.txt"
"""Where each rank was when a timeout or an interrupt stopped the run."""
_LIVE_MARKS = (PAYLOAD, KEY)  # removed when the job (or session) that owns the folder ends


class Records:
    """The kept files of one run: each rank's log, the metrics history, torchrun's log,
    and the ranks' stacks if a timeout or an interrupt stopped it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.metrics = path / METRICS
        self.launcher_log = path / LAUNCHER_LOG
        self.stacks = path / STACKS
        """Where each rank was when a timeout or an interrupt stopped the run."""

    @classmethod
    def create(cls, forget_old: bool = True) -> Records:
        """A new private folder for one run's records; the oldest beyond KEEP_RUNS go
        (``forget_old=False``: the caller calls ``forget_old_runs`` itself, later)."""
        records = cls(_new_folder())
        if forget_old:
            forget_old_runs()
        return records

    def rank_log(self, rank: int) -> Path:
        return self.path / rank_log_name(rank)

    def read_logs(self, nprocs: int) -> dict[int, str]:
        """Every rank's output (the last 64 MB of it), for errors and ``Job.logs``."""
        logs = {}
        for rank in range(nprocs):
            try:
                with open(self.rank_log(rank), "rb") as f:
                    f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_TAIL_BYTES))
                    logs[rank] = f.read().decode("utf-8", errors="replace")
            except FileNotFoundError:
                logs[rank] = ""
        return logs


def records_root() -> Path:
    configured = os.environ.get("NBDDP_RUNS_DIR")
    if configured:
        return Path(configured)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "nbddp" / "runs"


def _new_folder() -> Path:
    root = records_root()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = time.time()  # names sort in time order: microseconds, then a random tag
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f"{now % 1:.6f}"[1:]
    path = root / f"{_PREFIX}{stamp}-{secrets.token_hex(3)}"
    path.mkdir(mode=0o700)
    return path


def forget_old_runs() -> None:
    """Remove the oldest runs' records beyond KEEP_RUNS: at this process's first run, then
    every tenth (a session's runs come a millisecond apart, and listing the folders each
    time costs). A session calls it once its ranks have the run: the removal overlaps
    their work instead of delaying it."""
    global _created
    _created += 1
    if _created % PRUNE_EVERY == 1:
        _prune(records_root())


def folders(root: Path | None = None) -> list[Path]:
    """Every run's records folder under ``root`` (default ``records_root()``), oldest first."""
    root = records_root() if root is None else root
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(_PREFIX) and p.is_dir())


def _prune(root: Path) -> None:
    runs = folders(root)
    for old in runs[:-KEEP_RUNS]:
        if not any((old / mark).exists() for mark in _LIVE_MARKS):
            shutil.rmtree(old, ignore_errors=True)
