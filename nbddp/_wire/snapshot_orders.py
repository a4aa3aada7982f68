"""What the kernel and a session's ranks say of snapshots (``Session(snapshots=True)``).

After every cell that ends well on its rank, a rank keeps the names its cells bound,
with its RNG states, in one file of the session's snapshot folder, in shared memory
outside its process (``_rank.snapshot``). The kernel counts a cell as kept once it
ended well on every rank; when ranks are lost, the fresh ones load the newest cell kept
that every rank has a file of, before the next cell runs (``_run.session.snapshots``).

The Start of a cell carries a ``SnapshotOrder``: where, under which cell number, and
which older cell to keep (the newest the kernel counted as kept: a cell that failed on
another rank may not replace it). The first Start to fresh ranks also carries a
``RestoreOrder``. Ranks say what they restored in their ``Result`` (a ``RestoreNote``),
and what their snapshot could not keep once it is written (``SnapshotTaken``).
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


def manifest_file(snapshot: Path) -> Path:
    """Where a snapshot's manifest is: the part files it names (``_rank.snapshot_parts``),
    their bytes, and the names it could not keep."""
    return snapshot.with_suffix(".manifest")


@dataclass(frozen=True)
class Manifest:
    """What a snapshot's manifest says."""

    parts: frozenset[str] = frozenset()
    parts_bytes: int = 0
    skipped: tuple[tuple[str, str], ...] = ()


def write_manifest(snapshot: Path, parts: set[str],
                   skipped: tuple[tuple[str, str], ...]) -> None:
    """Write ``snapshot``'s manifest, private, in one step."""
    folder = snapshot.parent
    text = json.dumps({"parts": sorted(parts), "skipped": [list(pair) for pair in skipped],
                       "bytes": sum((folder / name).stat().st_size for name in parts)})
    passing = folder / f".{manifest_file(snapshot).name}"
    fd = os.open(passing, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(passing, manifest_file(snapshot))


def read_manifest(snapshot: Path) -> Manifest:
    """``snapshot``'s manifest (an empty one where there is none)."""
    try:
        said = json.loads(manifest_file(snapshot).read_text())
        return Manifest(frozenset(said["parts"]), int(said["bytes"]),
                        tuple((name, why) for name, why in said["skipped"]))
    except (OSError, ValueError, KeyError, TypeError):
        return Manifest()


def snapshot_size(snapshot: Path) -> int:
    """A snapshot's bytes: its file's and its parts'."""
    try:
        own = snapshot.stat().st_size
    except OSError:
        return 0
    return own + read_manifest(snapshot).parts_bytes


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
    """(In ``SnapshotTaken``) The names this rank could not keep in its snapshot of
    ``cell``, each with why."""

    cell: int
    skipped: tuple[tuple[str, str], ...] = ()
    too_large: int = 0
    """The bytes the snapshot would have taken, over this rank's share of the cap: it
    was not kept (0: it fits)."""
    written: bool = False
    """The snapshot is whole in the folder."""


@dataclass(frozen=True)
class RestoreNote:
    """(In a Result) What this rank loaded from its snapshot of ``cell``."""

    cell: int
    names: tuple[str, ...]
    size: int
