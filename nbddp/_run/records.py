"""Where a run's records stay after it ends: every rank's full log and the metrics history.

A rank group's temporary run dir (payload, key, socket) is removed when its run ends;
the run's records are kept on purpose, like torchrun's ``--log-dir``, so a failure or a
flood of output can be read in full later. They go to ``$NBDDP_RUNS_DIR`` (default
``~/.cache/nbddp/runs``), one private folder per run; the newest ``KEEP_RUNS`` are kept
(looked at every ``PRUNE_EVERY`` runs).
A SLURM job's folder is also its run dir: while its payload is there the job may still be
running (or waiting to be re-attached), so it is never pruned.

A session on this machine keeps one folder for its cells (``SessionRecords``): each
rank's log grows cell after cell, and a cell's part of it starts where the log ended
when the cell was handed over. Making and removing a folder and its files for every
cell cost about a fifth of a trivial cell's time. The session holds a lock on the
folder while it lives, so that no kernel prunes it.

The names of the files a rank writes (its log) or shares with the run dir are
``_wire.rundir``'s; the records' own names are spelled here.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import secrets
import shutil
import threading
import time
from collections.abc import Mapping
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
LIVE_LOCK = "session.lock"
"""Locked by the kernel whose session writes in the folder, while it lives (the lock
goes with the kernel however it ends)."""
MAKE_LOGS_UP_TO = 64
"""Ranks whose logs the kernel makes ahead, in a session's cell folder; past that each
rank makes its own, on its node (thousands of files per cell would be the kernel's
largest cost on a large cluster)."""
CELLS_PER_FOLDER = 1000
"""A session starts a new folder after this many cells, or once a rank's log holds
``LOG_TAIL_BYTES``: the old one may then be pruned like any run's."""


class Records:
    """The kept files of one run: each rank's log, the metrics history, torchrun's log,
    and the ranks' stacks if a timeout or an interrupt stopped it."""

    def __init__(self, path: Path, cell: int | None = None,
                 log_starts: Mapping[int, int] | None = None) -> None:
        """The run's records in ``path``; ``cell``: the run is that cell of a session
        whose ranks' logs, in ``path``, begin this cell at ``log_starts`` (and end where
        each rank says they reached as it reports: see ``reached``)."""
        self.path = path
        self._log_starts = dict(log_starts or {})
        self._log_ends: dict[int, int] = {}  # once the session's next cell began
        self._reached: dict[int, int] | None = None if log_starts is None else {}
        self._shown: dict[int, int] = {}  # (where a tail of this cell read to)
        self._own = "" if cell is None else f"-{cell}"
        self.metrics = path / METRICS.replace(".", f"{self._own}.", 1)

    @functools.cached_property
    def launcher_log(self) -> Path:
        return self.path / LAUNCHER_LOG

    @functools.cached_property
    def stacks(self) -> Path:
        """Where each rank was when a timeout or an interrupt stopped the run."""
        return self.path / STACKS.replace(".", f"{self._own}.", 1)

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

    def log_start(self, rank: int) -> int:
        """Where this run's part of ``rank_log(rank)`` begins (0 but in a session's folder)."""
        return self._log_starts.get(rank, 0)

    def log_end(self, rank: int) -> int | None:
        """Where this run's part of ``rank_log(rank)`` ends; None while it may grow."""
        end = self._log_ends.get(rank)
        return self._said(rank) if end is None else end

    def reached(self, rank: int, size: int) -> None:
        """(A session's cell whose logs the ranks keep) ``rank`` says, as it reports, that
        its log reached ``size`` bytes with all it wrote in the cell: the cell's part
        ends there, and the next cell's begins there. So the kernel need not look at
        every rank's log before each cell. What a rank's thread writes after its report
        is the next cell's (unless this cell showed it already: ``shown``)."""
        if self._reached is not None:
            self._reached[rank] = size

    def shown(self, rank: int, size: int) -> None:
        """This cell's output, as shown, was read from ``rank``'s log up to ``size``: if
        that is past where the rank said its log reached (its thread wrote on while its
        report came), the cell's part ends there instead, so nothing is shown twice."""
        if self._reached is not None:
            self._shown[rank] = size

    def _said(self, rank: int) -> int | None:
        """Where ``rank`` said its log reached (or this cell showed it to, if further);
        None if it has not said."""
        if self._reached is None or rank not in self._reached:
            return None
        return max(self._reached[rank], self._shown.get(rank, 0))

    def reached_so_far(self) -> dict[int, int]:
        """``_said`` of each rank that reported."""
        return {rank: self._said(rank) or 0 for rank in self._reached or ()}

    def ended_at(self, log_ends: Mapping[int, int]) -> None:
        """The session's next cell began: this one's part of each log ends there (a rank
        not named: at its log's end, as far as it will grow; so what the ranks' processes
        write after they were replaced is this cell's, the last they ran)."""
        self._log_ends = dict(log_ends)
        self._reached, self._shown = None, {}

    def read_logs(self, nprocs: int) -> dict[int, str]:
        """Every rank's output in this run (the last 64 MB of it), for errors and
        ``Job.logs``."""
        logs = {}
        for rank in range(nprocs):
            try:
                with open(self.rank_log(rank), "rb") as f:
                    end = self.log_end(rank)
                    if end is None:
                        end = os.fstat(f.fileno()).st_size
                    start = max(self.log_start(rank), end - LOG_TAIL_BYTES)
                    f.seek(start)
                    logs[rank] = f.read(max(0, end - start)).decode("utf-8", errors="replace")
            except FileNotFoundError:
                logs[rank] = ""
        return logs


class FolderPerCell:
    """The records of a session's cells, a folder each (a SLURM session's: its ranks on
    other machines write their logs there, and a size read over a network file system
    may lag behind what they wrote, so a cell's part of a log cannot be found by it).
    The next cell's folder is made while the ranks run this one."""

    def __init__(self, nprocs: int, make_logs: bool = True) -> None:
        """``make_logs``: the ranks open their logs in the folder (on a shared filesystem),
        so they are made ahead; not where the kernel writes what the ranks send (a Ray
        session's), only for the ranks that write."""
        self._nprocs = nprocs
        self._make_logs = make_logs and nprocs <= MAKE_LOGS_UP_TO
        self._lock = threading.Lock()
        self._next: Records | None = None
        self._closed = False

    def next_cell(self, number: int) -> Records:
        """The records of the session's cell ``number``: a folder of its own."""
        with self._lock:
            records, self._next = self._next, None
        return records or Records.create(forget_old=False)

    def prepare(self) -> None:
        """While the ranks run a cell: the oldest runs' records go, and the next cell's
        folder and its ranks' logs are made now (a new file is among a disk's slowest
        calls, and the kernel has nothing else to do meanwhile; a rank then opens its
        log as it is). Past ``MAKE_LOGS_UP_TO`` ranks, each rank makes its own."""
        forget_old_runs()
        ahead = Records.create(forget_old=False)
        if self._make_logs:
            _make_logs(ahead.path, self._nprocs)
        with self._lock:
            if self._closed or self._next is not None:
                shutil.rmtree(ahead.path, ignore_errors=True)
            else:
                self._next = ahead

    def new_ranks(self) -> None:
        """(Each cell has a folder of its own already: nothing to do.)"""

    def redo(self, records: Records, number: int) -> Records:
        """(The cell keeps its folder on fresh ranks.)"""
        return records

    def close(self) -> None:
        """The session ended: the folder made ahead for a cell that never came goes."""
        with self._lock:
            self._closed = True
            ahead, self._next = self._next, None
        if ahead is not None:
            shutil.rmtree(ahead.path, ignore_errors=True)


class SessionRecords:
    """The records of a session's cells on this machine, one folder for all of them (a
    new one every ``CELLS_PER_FOLDER`` cells, or once a log is long): its ranks keep
    their log file from cell to cell, and nothing is made or removed per cell."""

    def __init__(self, nprocs: int) -> None:
        self._nprocs = nprocs
        self._folder: Path | None = None
        self._lock_fd: int | None = None
        self._in_folder = 0  # cells
        self._last: Records | None = None  # the latest cell's
        self._ended: Records | None = None  # the cell's before it, ended where it began
        self._logs: list[str] = []  # each rank's, in the folder
        self._lock_path = ""  # the folder's lock file (asked about before each cell)

    def next_cell(self, number: int) -> Records:
        """The records of the session's cell ``number``: where each rank's log ends now
        is where its part of the log begins (called before the cell is handed over)."""
        if self._folder is None or self._in_folder >= CELLS_PER_FOLDER:
            self._new_folder()
        assert self._folder is not None
        starts = self._log_starts()
        if starts is None or max(starts.values()) >= LOG_TAIL_BYTES:
            self._new_folder()  # (the folder was removed under the session, or is full)
            return self.next_cell(number)
        self._ended = self._last_in_folder()
        if self._ended is not None:
            self._ended.ended_at(starts)
        self._in_folder += 1
        self._last = Records(self._folder, number, starts)
        return self._last

    def _log_starts(self) -> dict[int, int] | None:
        """Where each rank's part of its log begins for the next cell: where the last
        cell's rank said its log reached (``Records.reached``), else the log's size now;
        None if the folder is gone. When every rank said, one look at the folder's lock
        file replaces one at each rank's log; else the logs are looked at (a cell on some
        ranks, a rank that ended without its report)."""
        last = self._last_in_folder()
        said = last.reached_so_far() if last is not None else {}
        if len(said) == self._nprocs:
            return said if os.path.exists(self._lock_path) else None
        sizes = self._log_sizes()
        return None if sizes is None else {**sizes, **said}

    def _last_in_folder(self) -> Records | None:
        """The latest cell's records, if that cell's logs are the current folder's."""
        last = self._last
        return last if last is not None and last.path is self._folder else None

    def _log_sizes(self) -> dict[int, int] | None:
        """Each rank's log's size now; None if the folder is gone."""
        try:
            return {rank: os.stat(log).st_size for rank, log in enumerate(self._logs)}
        except FileNotFoundError:
            return None

    def prepare(self) -> None:
        """(Nothing to make ahead: the folder and its logs are there.)"""

    def new_ranks(self) -> None:
        """The session's ranks were replaced: the next cell starts a folder of its own.
        What the old ranks' processes still write (as they are stopped, or a process a
        rank started) stays with the last cell they ran, not under the next."""
        self._in_folder = CELLS_PER_FOLDER
        if self._last is not None:
            self._last.ended_at({})

    def redo(self, records: Records, number: int) -> Records:
        """Cell ``number``, whose ``records`` were made for ranks found gone as it was
        handed over, goes to fresh ones (after ``new_ranks``): its records anew, and the
        rest of the old ranks' logs is the cell's before, which they ran last."""
        if self._ended is not None:
            self._ended.ended_at({})
        return self.next_cell(number)

    def _new_folder(self) -> None:
        """A new folder, locked, with each rank's log; the old one (if any) is released
        once the new one is pruned around (it is not pruned at once)."""
        folder = _new_folder()
        lock_path = str(folder / LIVE_LOCK)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):  # no locks on this file system: kept anyway
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (a new file: never held)
        logs = _make_logs(folder, self._nprocs)
        forget_old_runs()
        self.close()
        self._folder, self._lock_fd, self._logs, self._in_folder = folder, fd, logs, 0
        self._lock_path = lock_path

    def close(self) -> None:
        """The session ended: its folder stays as records, to be pruned like a run's."""
        if self._lock_fd is not None and self._folder is not None:
            Path(self._lock_path).unlink(missing_ok=True)
            os.close(self._lock_fd)
        self._folder, self._lock_fd = None, None


def _make_logs(folder: Path, nprocs: int) -> list[str]:
    """Each rank's empty log in ``folder`` (a rank then opens it as it is: a new file is
    among a disk's slowest calls); their paths."""
    logs = [str(folder / rank_log_name(rank)) for rank in range(nprocs)]
    for log in logs:
        os.close(os.open(log, os.O_WRONLY | os.O_CREAT, 0o600))
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
        with contextlib.suppress(OSError):  # (one folder that cannot be read stops none)
            if not _in_use(old):
                shutil.rmtree(old, ignore_errors=True)


def _in_use(folder: Path) -> bool:
    """A SLURM job may still run with the folder, or a live session writes in it (its
    kernel holds the lock; where the file system cannot say, the folder is kept)."""
    if any((folder / mark).exists() for mark in _LIVE_MARKS):
        return True
    try:
        fd = os.open(folder / LIVE_LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:  # (shared against the owner's exclusive lock: a read-only file may take it, on NFS too)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:  # held (EWOULDBLOCK), or no locks here (ENOLCK, ENOSYS...)
        return True
    finally:
        os.close(fd)
