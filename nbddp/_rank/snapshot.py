"""A session rank's snapshot: the names its cells bound, kept outside its process.

With snapshots on (``_wire.snapshot_orders``), each cell's Start asks the rank to keep,
once the cell ended well here, the names its code has bound and its RNG states (torch's,
CUDA's, numpy's, ``random``'s). They are pickled as one object, so that what they share
stays shared when they come back (an optimizer's parameters are the model's), through
the data plane: tensors' bytes out of band, never in the pickle; a large one in a part
file of its own, which the next snapshot names again, copying nothing, while the tensor
is unchanged (``_rank.snapshot_parts``); a CUDA tensor comes back on the rank's own
GPU. A name that cannot be pickled is left out, and the ``SnapshotNote`` in the rank's
``Result`` names it with why. A snapshot larger than the rank's share of the session's
cap is not kept, and the note says how large it would have been.

The snapshot is made once the rank's Result is sent, while the rank is at rest (a cell
pays nothing for it; the next waits for it only if it comes first): pickled, then
written into a file of the session's snapshot folder in shared memory, under a passing
name, then renamed, so a rank killed while writing leaves the last whole one. Beside it,
its manifest lists its parts and the names it could not keep; the rank then tells the
kernel the same (``SnapshotTaken``). A rank the cell did not run on
(a cell on some ranks only) holds what it held: its last file is linked under the new
cell. Fresh ranks that replace lost ones load their own file back before the next
cell (``restore``), once the process group is up (a DDP model is rebuilt on it).
"""

from __future__ import annotations

import os
import random
import stat
import sys
from pathlib import Path
from typing import Any

from .._wire import dataplane
from .._wire.snapshot_orders import (
    RestoreNote,
    RestoreOrder,
    SnapshotNote,
    SnapshotOrder,
    manifest_file,
    read_manifest,
    snapshot_file,
    snapshot_files,
    snapshot_size,
    write_manifest,
)
from .scope import Scope
from .snapshot_parts import SnapshotParts, parts_loaded


class Snapshots:
    """(On a rank) Its snapshots, and the part files its large tensors are in
    (``_rank.snapshot_parts``)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.parts = SnapshotParts(rank)
        self._latest: Path | None = None
        """This rank's newest snapshot, if it holds the rank's state still (a run since
        that kept no snapshot, or failed, leaves none)."""
        self._unpicklable: dict[str, tuple[int, str]] = {}
        """Names found not to pickle: the object's id then, and why (not tried again)."""

    def ran_without(self) -> None:
        """A run changed what the rank holds and no snapshot of it was written."""
        self._latest = None

    def keep(self, scope: Scope, order: SnapshotOrder, ran: bool) -> SnapshotNote:
        """(At rest) Take and write the snapshot ``order`` asks for (``ran``: the cell ran
        here; else the rank's last snapshot, if it still holds its state, stands for this
        cell too): what the kernel is told of it."""
        folder = Path(order.folder)
        if not ran and self._latest is not None and self._latest.exists():
            last = read_manifest(self._latest)
            written = self._write(folder, order, None, set(last.parts), last.skipped)
            return SnapshotNote(order.cell, last.skipped, written=written)
        self._latest = None
        names = {name: scope.globals[name] for name in sorted(scope.assigned)
                 if name in scope.globals}
        self.parts.folder = folder
        packed, skipped = self._packed(names)
        parts = self.parts.named()
        size = dataplane.size_of(packed) + sum(parts.values())
        if order.max_bytes and size > order.max_bytes:
            self.parts.drop_new()
            return SnapshotNote(order.cell, skipped, too_large=size)
        written = self._write(folder, order, packed, set(parts), skipped)
        return SnapshotNote(order.cell, skipped, written=written)

    def _packed(self, names: dict[str, Any]) -> tuple[dataplane.Packed,
                                                      tuple[tuple[str, str], ...]]:
        """``names`` and the RNG states in one pickle, large storages as their parts; the
        names left out, each with why (found one by one, each pickled on its own, and
        remembered while they hold the same object)."""
        rng = _rng_states()
        known = {name: why for name, (ident, why) in self._unpicklable.items()
                 if name in names and id(names[name]) == ident}
        for attempt in range(2):
            kept = {name: value for name, value in names.items() if name not in known}
            try:
                packed = dataplane.pack({"names": kept, "rng": rng}, kept=self.parts)
                self._unpicklable = {name: (id(names[name]), why)
                                     for name, why in known.items()}
                return packed, tuple(known.items())
            except Exception as exc:  # noqa: BLE001 - each name said, with why
                self.parts.drop_new()
                if attempt:
                    known = {name: f"{type(exc).__name__}: {exc}" for name in names}
                    break
                known.update(_unpicklable(kept))
        return dataplane.pack({"names": {}, "rng": rng}), tuple(known.items())

    def _write(self, folder: Path, order: SnapshotOrder, packed: dataplane.Packed | None,
               parts: set[str], skipped: tuple[tuple[str, str], ...]) -> bool:
        """Write the snapshot, whole or not at all: its new parts, its manifest, then the
        snapshot itself (``packed``, or a link to the last one), under a passing name,
        renamed; then remove this rank's older snapshots, but for the cell the kernel
        said to keep, and the parts no kept snapshot names (those that only snapshots
        older than the kept cell and this rank's newest named go first: new parts are
        written over them). Whether it was written (a
        failure, no room left, is said on the rank's output; nothing, where snapshots were
        turned off meanwhile and the folder is gone)."""
        path = snapshot_file(folder, self.rank, order.cell)
        passing = folder / f".{path.name}.{os.getpid()}"
        try:
            if packed is None:
                assert self._latest is not None
                os.link(self._latest, passing)
            else:
                self._remove_older(folder, keep={order.keep}, newest=True, also=parts, recycle=True)
                self.parts.write_new()
                dataplane.write(passing, packed)
            write_manifest(path, parts, skipped)
            os.replace(passing, path)
        except OSError as exc:
            passing.unlink(missing_ok=True)
            self.parts.drop_new()
            self._latest = None
            if folder.is_dir():
                print(f"nbddp: rank {self.rank} could not keep its snapshot of cell "
                      f"{order.cell} ({exc})", file=sys.stderr, flush=True)
            return False
        self._latest = path
        self._remove_older(folder, keep={order.cell, order.keep})
        return True

    def _remove_older(self, folder: Path, keep: set[int], newest: bool = False,
                      also: set[str] | frozenset[str] = frozenset(),
                      recycle: bool = False) -> None:
        """Remove this rank's snapshots but ``keep``'s (and its ``newest``), the parts
        none of those name (nor ``also``, a snapshot's being written), and what a writer
        of this rank left half done (one killed while writing); with ``recycle``, the
        parts go to the spares its new parts are written over."""
        named: set[str] = set(also)
        files = {cell: ranks[self.rank] for cell, ranks in snapshot_files(folder).items()
                 if self.rank in ranks}
        if newest and files:
            keep = keep | {max(files)}
        for cell, file in files.items():
            if cell in keep:
                named |= read_manifest(file).parts
            else:
                file.unlink(missing_ok=True)
                manifest_file(file).unlink(missing_ok=True)
        for passing in folder.glob(f".rank{self.rank}-*"):
            passing.unlink(missing_ok=True)
        self.parts.folder = folder
        self.parts.remove_unnamed(named, recycle)

    def restore(self, scope: Scope, order: RestoreOrder) -> RestoreNote:
        """Load this rank's snapshot of ``order.cell`` into ``scope`` (the names count as
        the rank's own), and its RNG states, from the session's folder (only if it is
        this user's own, and nobody else's)."""
        folder = Path(order.folder)
        path = snapshot_file(folder, self.rank, order.cell)
        try:
            _check_private(folder)
            with parts_loaded(folder) as loaded:
                state = dataplane.read(path).load()
            self.parts.mapped.update(loaded)
        except Exception as exc:
            raise RuntimeError(f"nbddp: rank {self.rank} could not load its snapshot of "
                               f"cell {order.cell}: {type(exc).__name__}: {exc}") from exc
        scope.restore(state["names"])
        _set_rng_states(state["rng"])
        self._latest = path
        return RestoreNote(order.cell, tuple(sorted(state["names"])), snapshot_size(path))


def _check_private(folder: Path) -> None:
    """PermissionError unless ``folder`` is a directory of this user's that nobody else
    may write to or read (what is in it is unpickled)."""
    status = os.lstat(folder)
    if (not stat.S_ISDIR(status.st_mode) or status.st_uid != os.geteuid()
            or status.st_mode & 0o077):
        raise PermissionError(f"{folder} is not a private folder of this user's")


def _unpicklable(names: dict[str, Any]) -> dict[str, str]:
    """The names that cannot be pickled on their own, each with why."""
    found = {}
    for name, value in names.items():
        try:
            dataplane.pack(value)
        except Exception as exc:  # noqa: BLE001 - each said, with why
            found[name] = f"{type(exc).__name__}: {exc}"
    return found


def _rng_states() -> dict[str, Any]:
    """The RNG states a rank's code may draw from (numpy's only if it was imported)."""
    import torch

    states: dict[str, Any] = {"random": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    import torch

    random.setstate(states["random"])
    torch.set_rng_state(states["torch"])
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if "numpy" in states:
        import numpy

        numpy.random.set_state(states["numpy"])
