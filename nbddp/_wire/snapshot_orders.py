"""What the kernel and a session's ranks say of snapshots (``Session(snapshots=True)``).

After every cell that ends well on its rank, a rank keeps the names its cells bound,
with its RNG states, in one file of the session's snapshot folder, in shared memory
outside its process (``_rank.snapshot``). The kernel counts a cell as kept once it
ended well on every rank; when ranks are lost, the fresh ones load the newest cell kept
that every rank has a file of, before the next cell runs (``_run.session.snapshots``).

The Start of a cell carries a ``SnapshotOrder``: where, under which cell number, and
which older cell to keep (the newest the kernel counted as kept: a cell that failed on
another rank may not replace it). The first Start to fresh ranks also carries a
``RestoreOrder``. Ranks answer with a ``SnapshotNote`` (and a ``RestoreNote``) in their
``Result``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

_FILE = "rank{rank}-cell{cell}.snapshot"
_FILE_PATTERN = re.compile(r"rank(\d+)-cell(\d+)\.snapshot")


def snapshot_file(folder: Path, rank: int, cell: int) -> Path:
    """Where ``rank`` keeps its snapshot of ``cell``."""
    return folder / _FILE.format(rank=rank, cell=cell)


def snapshot_files(folder: Path) -> dict[int, dict[int, Path]]:
    """Each cell's complete snapshot files in ``folder``, by cell, then by rank (a file
    still being written has another name)."""
    found: dict[int, dict[int, Path]] = {}
    try:
        entries = list(folder.iterdir())
    except OSError:
        return found
    for path in entries:
        match = _FILE_PATTERN.fullmatch(path.name)
        if match:
            found.setdefault(int(match.group(2)), {})[int(match.group(1))] = path
    return found


def parts_file(snapshot: Path) -> Path:
    """Where the part files a snapshot names are listed (``_rank.snapshot_parts``)."""
    return snapshot.with_suffix(".parts")


def write_parts_list(snapshot: Path, names: set[str]) -> None:
    """List ``names`` (with their bytes) beside ``snapshot``, private, in one step."""
    folder = snapshot.parent
    listed = json.dumps({"parts": sorted(names),
                         "bytes": sum((folder / name).stat().st_size for name in names)})
    passing = folder / f".{parts_file(snapshot).name}"
    fd = os.open(passing, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(listed)
    os.replace(passing, parts_file(snapshot))


def listed_parts(snapshot: Path) -> tuple[set[str], int]:
    """The part files listed beside ``snapshot``, and their bytes (none without a list)."""
    try:
        listed = json.loads(parts_file(snapshot).read_text())
    except (OSError, ValueError):
        return set(), 0
    return set(listed["parts"]), int(listed["bytes"])


def snapshot_size(snapshot: Path) -> int:
    """A snapshot's bytes: its file's and its parts'."""
    try:
        own = snapshot.stat().st_size
    except OSError:
        return 0
    return own + listed_parts(snapshot)[1]


@dataclass(frozen=True)
class SnapshotOrder:
    """(In a Start) Once the run ends well here, keep this rank's names as ``cell`` in
    ``folder``; of the older snapshots, keep only ``keep``'s. A snapshot of more than
    ``max_bytes`` (this rank's share of the cap; 0: none) is not kept."""

    folder: str
    cell: int
    keep: int = 0
    max_bytes: int = 0


@dataclass(frozen=True)
class RestoreOrder:
    """(In the first Start to fresh ranks) Before the run, load this rank's snapshot of
    ``cell`` from ``folder``."""

    folder: str
    cell: int


@dataclass(frozen=True)
class SnapshotNote:
    """(In a Result) The names this rank could not keep, each with why (those it could
    are in the snapshot, written once the Result is sent)."""

    cell: int
    skipped: tuple[tuple[str, str], ...] = ()
    too_large: int = 0
    """The bytes the snapshot would have taken, over this rank's share of the cap: it
    was not kept (0: it fits)."""


@dataclass(frozen=True)
class RestoreNote:
    """(In a Result) What this rank loaded from its snapshot of ``cell``."""

    cell: int
    names: tuple[str, ...]
    size: int
