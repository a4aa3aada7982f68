"""A session's snapshots, as the kernel keeps them: their folder, the cells kept, and
what fresh ranks restore (``Session(snapshots=True)``, ``%ddp_session snapshots on``).

The ranks write the files (``_rank.snapshot``); the kernel owns the folder, in shared
memory, private (0700). It must outlive the ranks, which a snapshot is for, and go with
the kernel, even one that is killed: a small keeper process holds the read end of a
pipe from the kernel, and removes the folder when the pipe closes (the session turns
snapshots off or stops, or the kernel dies). The keeper imports nothing but the
standard library.

A cell is kept once it ended well on every rank: its names (rank 0's) are noted. When
ranks are lost, the newest kept cell that every rank has a file of is the one the fresh
ranks load before the next cell (``RestoreOrder``); what the notebook is told says so,
once, with the names that could not be kept.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

from ..._errors import NbddpError
from ..._wire.dataplane import shm_root
from ..._wire.messages import SnapshotTaken
from ..._wire.rundir import reserved_name
from ..._wire.snapshot_orders import (
    RestoreOrder,
    SnapshotNote,
    SnapshotOrder,
    read_manifest,
    snapshot_files,
    snapshot_size,
)

_KEEPER = ("import os, shutil, sys, time\n"
           "while sys.stdin.buffer.read(4096): pass\n"
           "for _ in range(120):\n"
           "    shutil.rmtree(sys.argv[1], ignore_errors=True)\n"
           "    if not os.path.exists(sys.argv[1]): break\n"
           "    time.sleep(0.5)\n")
"""The keeper: waits for the kernel's end of the pipe to close, then removes the folder
(again, for a minute at most, while a rank still writing puts files back)."""
_CELLS_NOTED = 4  # kept cells whose names the kernel remembers (the ranks keep two)


class SessionSnapshots:
    """(In the kernel) A session's snapshots: off until ``turn_on``."""

    def __init__(self, nprocs: int) -> None:
        self.nprocs = nprocs
        self.folder: Path | None = None
        self._keeper: subprocess.Popen[bytes] | None = None
        self._kept: dict[int, tuple[str, ...]] = {}
        """Each cell that ended well on every rank: the names the ranks held then (less
        those their snapshots could not keep: their manifests say)."""
        self._written: dict[int, set[int]] = {}
        """Of those, the ranks that said their snapshot is written: a cell every rank
        wrote is the one the ranks keep while they write the next ones."""
        self._said: set[str] = set()  # names said once as not kept
        self.max_bytes = 0
        """The cap on all ranks' snapshots together (each rank gets its share)."""
        self._over_said = False  # (a snapshot over the cap: said once, until one fits)
        self._over_cell = 0  # (the last cell whose snapshot was over the cap)
        self.restoring: RestoreOrder | None = None
        """What the next run's fresh ranks load first (set once ranks were lost)."""
        self._lost_note: tuple[str, str] | None = None

    @property
    def on(self) -> bool:
        return self.folder is not None

    @property
    def writing(self) -> bool:
        """The newest kept cell's snapshot is not yet written on every rank, as far as the
        ranks said."""
        newest = max(self._kept, default=0)
        return self.on and newest > 0 and self._written.get(newest) != set(range(self.nprocs))

    def turn_on(self, max_bytes: int | None = None) -> None:
        """Make the folder, with its keeper (no snapshot yet: the next cell's is the
        first); ``max_bytes``: the cap (default: a quarter of the memory free now). On
        already, only the cap changes. NbddpError if there is no shared memory to keep
        them in."""
        self.max_bytes = max_bytes or _free_memory() // 4
        self._over_said = False
        if self.on:
            return
        root = shm_root()
        if root is None:
            raise NbddpError("snapshots are kept in shared memory, and this machine has "
                             "none that nbddp can write to (/dev/shm, or NBDDP_SHM_DIR)")
        folder = reserved_name("nbddp-snapshots-", root)
        folder.mkdir(mode=0o700)
        try:
            self._keeper = subprocess.Popen(
                [sys.executable, "-c", _KEEPER, str(folder)], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, start_new_session=True)  # (no Ctrl-C of ours)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self.folder = folder
        _KEEPERS.add(self._keeper)

    def turn_off(self) -> None:
        """Remove every snapshot and the folder; the keeper ends."""
        folder, keeper = self.folder, self._keeper
        self.folder, self._keeper = None, None
        self.forget()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        if keeper is not None:
            if keeper.stdin is not None:
                keeper.stdin.close()
            keeper.wait()

    def forget(self) -> None:
        """Fresh ranks that restore nothing (a restart asked for): no cell is kept."""
        self._kept.clear()
        self._written.clear()
        self.restoring, self._lost_note = None, None
        if self.folder is not None:  # (snapshots, their parts and lists)
            for path in self.folder.iterdir():
                path.unlink(missing_ok=True)

    # --- each run -------------------------------------------------------------------

    def order(self, cell: int) -> SnapshotOrder | None:
        """What a run's Start asks of the ranks: keep their names as ``cell``."""
        if self.folder is None:
            return None
        every = set(range(self.nprocs))
        whole = [kept for kept in self._kept if self._written.get(kept) == every]
        return SnapshotOrder(str(self.folder), cell, max(whole, default=0),
                             self.max_bytes // self.nprocs)

    def ended(self, cell: int, returned: bool, names: frozenset[str]) -> None:
        """A run ended with the ranks kept (``returned``: on every rank; ``names``: those
        the ranks hold now): the cell is kept, if every rank writes its snapshot."""
        self.restoring, self._lost_note = None, None
        if self.folder is not None and returned:
            self._kept[cell] = tuple(sorted(names))
            for old in sorted(self._kept)[:-_CELLS_NOTED]:
                del self._kept[old]
                self._written.pop(old, None)

    def noted(self, taken: list[SnapshotTaken]) -> None:
        """What the ranks said of their snapshots: which are written; names not kept are
        said once each; a snapshot over the cap, once, until one fits again."""
        self._say_not_kept({name: why for each in taken for name, why in each.note.skipped})
        for rank, note in sorted(((each.rank, each.note) for each in taken),
                                 key=lambda said: said[1].cell):
            if note.written and note.cell in self._kept:
                self._written.setdefault(note.cell, set()).add(rank)
            if note.too_large:
                self._kept.pop(note.cell, None)  # (no rank keeps an older one for it)
                self._say_over(note)
            elif note.cell > self._over_cell:
                self._over_said = False

    def _say_not_kept(self, skipped: dict[str, str]) -> None:
        new = {name: why for name, why in skipped.items() if name not in self._said}
        if new:
            self._said.update(new)
            print("nbddp: session snapshots cannot keep " + "; ".join(
                f"{name} ({why})" for name, why in new.items()) + ": if the ranks are "
                "lost, these are not restored", file=sys.stderr, flush=True)

    def _say_over(self, note: SnapshotNote) -> None:
        self._over_cell = max(self._over_cell, note.cell)
        if self._over_said:
            return
        self._over_said = True
        kept = [cell for cell in self._kept if cell < note.cell]
        print(f"nbddp: session snapshots paused: one of cell {note.cell} would take "
              f"{_size(note.too_large)}, "
              f"over its share ({_size(self.max_bytes // self.nprocs)}) of the "
              f"{_size(self.max_bytes)} cap, so none is taken until they fit again; the "
              f"newest kept: {f'cell {max(kept)}' if kept else 'none'} (a larger cap: "
              "%ddp_session snapshots on "
              "--snapshot-max SIZE)", file=sys.stderr, flush=True)

    # --- ranks lost -----------------------------------------------------------------

    def when_lost(self, cell_lost: bool) -> str | None:
        """The ranks are gone: what fresh ones will restore (None: nothing, snapshots are
        off or no cell was kept), the next run carrying the order; ``cell_lost``: a cell
        was running, and is lost."""
        if self._lost_note is None and self.folder is not None:
            self._lost_note = self._restore_from(snapshot_files(self.folder))
        if self._lost_note is None:
            return None
        restore, not_kept = self._lost_note
        return "; ".join([restore] + ["the cell that was running is lost"] * cell_lost
                         + [f"not restored: {not_kept}"] * bool(not_kept))

    def _restore_from(self, files: dict[int, dict[int, Path]]) -> tuple[str, str] | None:
        """The restore order for the newest kept cell every rank has a file of, and what
        to say of it: what it restores, what it cannot."""
        assert self.folder is not None
        for passing in self.folder.glob(".*"):  # (what ranks killed while writing left)
            passing.unlink(missing_ok=True)
        whole = [cell for cell in self._kept
                 if set(files.get(cell, {})) >= set(range(self.nprocs))]
        if not whole:
            return None
        cell = max(whole)
        size = sum(snapshot_size(path) for path in files[cell].values())
        self.restoring = RestoreOrder(str(self.folder), cell)
        for newer in [kept for kept in self._kept if kept > cell]:  # (no fresh rank has it)
            del self._kept[newer]
            self._written.pop(newer, None)
        self._written[cell] = set(range(self.nprocs))
        skipped = {name: why for path in files[cell].values()
                   for name, why in read_manifest(path).skipped}
        names = set(self._kept[cell]) - set(skipped)
        return (f"the session restarted on new ranks, which restore {len(names)} "
                f"name{'s' * (len(names) != 1)} from cell {cell} ({_size(size)}) first",
                "; ".join(f"{name} ({why})" for name, why in skipped.items()))

    def status(self) -> str:
        """What ``%ddp_session`` says of them."""
        if self.folder is None:
            return "snapshots off"
        on = f"snapshots on (at most {_size(self.max_bytes)})"
        files = snapshot_files(self.folder)
        kept = [cell for cell in self._kept if cell in files]
        newest = max(self._kept, default=0)
        coming = f"cell {newest}'s being written" if newest not in kept else ""
        if not kept:
            return f"{on}, none yet" + f" ({coming})" * bool(coming)
        cell = max(kept)
        sizes = {rank: snapshot_size(path) for rank, path in files[cell].items()}
        per_rank = ", ".join(f"rank {rank} {_size(size)}" for rank, size in sorted(sizes.items()))
        return f"{on}: cell {cell}, {per_rank}" + f"; {coming}" * bool(coming)


_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(value: int | str) -> int:
    """Bytes from ``value``: a number of bytes, or a size such as ``512MiB``, ``8GiB``
    or ``8G`` (binary units). ValueError if it is none."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?B)?\s*", str(value))
        if match is None:
            raise ValueError(f"a snapshot cap is a size such as 512MiB or 8GiB, got {value!r}")
        number, unit = float(match.group(1)), match.group(2).lower()
    nbytes = int(number * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"a snapshot cap must be more than 0 bytes, got {value!r}")
    return nbytes


def _free_memory() -> int:
    """The memory free on this machine now (``MemAvailable``)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


_KEEPERS: weakref.WeakSet[subprocess.Popen[bytes]] = weakref.WeakSet()
"""The keepers of this process's sessions."""


def _forget_keepers_after_fork() -> None:
    """A child forked from the kernel (a notebook's worker processes) closes its copies
    of the keepers' pipes: a child that outlived a killed kernel would keep its
    snapshots in memory."""
    for keeper in list(_KEEPERS):
        if keeper.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                keeper.stdin.close()


os.register_at_fork(after_in_child=_forget_keepers_after_fork)


def _size(nbytes: int) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.0f} MiB"
    return f"{nbytes / 2**10:.0f} KiB"
