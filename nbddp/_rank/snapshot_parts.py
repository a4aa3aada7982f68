"""A rank's large tensors in its snapshots: each storage's bytes in a file of their own,
kept from one snapshot to the next while the storage does not change.

A snapshot after every cell would copy every tensor the rank holds, every cell: a model
and its optimizer's state, gigabytes, for a cell that only printed. Instead a large CPU
storage is written once into a part file of the snapshot folder, and each snapshot's
pickle names the part (``_Part``: pickled as its file's name, found in the folder the
snapshot is loaded from and mapped copy-on-write), so that a snapshot copied whole to
another folder (another node's) loads from there. The next snapshot names the same part,
and copies nothing, while the storage is unchanged: the version counter of every tensor
object it was pickled for is where it was (torch bumps it at each in-place write, through
the tensor or its views), and a few random places of the storage still hold what the part
holds (writes that bypass the counter, through ``.data`` or NumPy, are caught where they
changed much of it).

A part is written at rest with the snapshot that first names it (``write_new``), under
a passing name, then renamed. It is written over a part file no kept snapshot names any
more, of the same size, where there is one (``recycle``): a storage that changes each
cell (a model's weights in training) costs a copy into memory already allocated, not
fresh pages of shared memory to allocate and zero, and old ones to free. A part this
rank loaded (a restore maps it copy-on-write, and would see what is written over it) is
never written over. Each snapshot's parts are listed beside it
(``rankR-cellN.parts``: their names and bytes), so that the rank removes its parts no
kept snapshot names, and the kernel can tell a snapshot's size.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import mmap
import os
import random
import secrets
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .._wire.dataplane import write_at
from .._wire.tensor_pickler import storage_from_buffer

PART_MIN = 4 * 2**20
"""Smaller storages stay in the snapshot's own file: a part of their own costs more."""
SAMPLES = 64
"""Random places of a storage compared with its part before the part is named again."""
SAMPLE_BYTES = 64
_SAMPLER = random.Random()  # (nbddp's own: the notebook's seed stays its own)


class _Part:
    """One storage's bytes in a part file: pickled as the file's name (not its path: a
    snapshot copied to another folder names its parts there)."""

    def __init__(self, path: Path, tensor: Any, storage: Any) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self.path = path
        self.nbytes = storage.nbytes()
        self.data_ptr = storage.data_ptr()
        self.storage = StorageWeakRef(storage)
        self.seen = [(weakref.ref(tensor), tensor._version)]
        """Each tensor object it was pickled for, and its version counter then."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _mapped_part, (self.path.name, self.nbytes)

    def also(self, tensor: Any) -> None:
        if not any(ref() is tensor for ref, _ in self.seen):
            self.seen.append((weakref.ref(tensor), tensor._version))

    def holds(self, tensor: Any, storage: Any) -> bool:
        """The part still holds ``tensor``'s storage as it is now."""
        return (not self.storage.expired() and storage.data_ptr() == self.data_ptr
                and storage.nbytes() == self.nbytes
                and any(ref() is tensor for ref, _ in self.seen)
                and not any(seen is not None and seen._version != version
                            for seen, version in ((ref(), v) for ref, v in self.seen))
                and self._same_sample(storage))

    def _same_sample(self, storage: Any) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return False
        try:
            address = storage.data_ptr()
            for _ in range(SAMPLES):
                offset = _SAMPLER.randrange(max(1, self.nbytes - SAMPLE_BYTES + 1))
                length = min(SAMPLE_BYTES, self.nbytes - offset)
                if os.pread(fd, length, offset) != ctypes.string_at(address + offset, length):
                    return False
            return True
        finally:
            os.close(fd)


_LOADING: tuple[Path, list[str]] | None = None
"""(While a snapshot is loaded) The folder it is loaded from, and the parts it maps."""


def _mapped_part(name: str, nbytes: int) -> Any:
    """(Loading a snapshot) The storage in part file ``name`` of the snapshot's folder,
    mapped copy-on-write."""
    if _LOADING is None:
        raise RuntimeError("nbddp: a snapshot's part is loaded only with its snapshot")
    folder, loaded = _LOADING
    if not name or Path(name).name != name or name.startswith("."):
        raise RuntimeError(f"nbddp: {name!r} is not the name of a snapshot's part")
    path = folder / name
    loaded.append(name)
    with open(path, "rb") as part:
        if os.fstat(part.fileno()).st_size != nbytes:
            raise RuntimeError(f"nbddp: the snapshot's part {path} is not whole")
        mapped = mmap.mmap(part.fileno(), nbytes, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return storage_from_buffer(mapped)


@contextlib.contextmanager
def parts_loaded(folder: Path) -> Iterator[list[str]]:
    """Inside, a snapshot loaded finds its parts in ``folder``; the names of those it maps."""
    global _LOADING
    loaded: list[str] = []
    _LOADING = (folder, loaded)
    try:
        yield loaded
    finally:
        _LOADING = None


class SnapshotParts:
    """(On a rank) Its part files in ``folder``: ``copy_of`` names a storage's part (a new
    one if it changed), as ``dataplane.pack``'s ``kept`` copies are named."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.folder: Path | None = None
        self._parts: dict[int, _Part] = {}
        self._numbers = itertools.count(1)
        self._named: dict[str, int] = {}  # the parts the snapshot being made names: bytes
        self._new: list[tuple[_Part, Any]] = []  # ... and those to write, with storages
        self._spares: dict[int, list[Path]] = {}  # part files to write over, by bytes
        self.mapped: set[str] = set()
        """The parts this rank loaded (a restore): never written over."""

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        self._named = {}
        yield

    def copy_of(self, tensor: Any, storage: Any) -> _Part | None:
        if (self.folder is None or storage.nbytes() < PART_MIN or tensor.is_inference()
                or storage.device.type != "cpu"):
            return None
        key = storage._cdata
        part = self._parts.get(key)
        if part is None or not part.holds(tensor, storage):
            name = f"rank{self.rank}-part{next(self._numbers)}-{secrets.token_hex(4)}.bin"
            part = self._parts[key] = _Part(self.folder / name, tensor, storage)
            self._new.append((part, storage))  # (kept alive until written)
        self._named[part.path.name] = part.nbytes
        return part

    def seen_with(self, copy: Any, tensor: Any) -> None:
        """``tensor`` is another on a storage this snapshot names as ``copy``: its
        writes, too, tell that the storage changed."""
        if isinstance(copy, _Part):
            copy.also(tensor)

    def named(self) -> dict[str, int]:
        """The parts the last snapshot made names, and their bytes."""
        return dict(self._named)

    def write_new(self) -> int:
        """Write the parts made for the last snapshot (OSError if there is no room); their
        bytes."""
        new, self._new = self._new, []
        written = 0
        for part, storage in new:
            passing = part.path.with_name(f".{part.path.name}")
            fd = self._open_for(part, passing)
            try:
                os.ftruncate(fd, part.nbytes)
                raw = (ctypes.c_ubyte * part.nbytes).from_address(storage.data_ptr())
                write_at(fd, memoryview(raw).cast("B"), 0)
            except BaseException:
                os.close(fd)
                passing.unlink(missing_ok=True)
                raise
            os.close(fd)
            os.replace(passing, part.path)
            written += part.nbytes
        self.drop_spares()
        return written

    def _open_for(self, part: _Part, passing: Path) -> int:
        """``passing``, open to write ``part`` into: a spare of its size renamed, if there
        is one, else a new file."""
        spares = self._spares.get(part.nbytes, [])
        while spares:
            spare = spares.pop()
            try:
                os.rename(spare, passing)
                return os.open(passing, os.O_WRONLY)
            except OSError:
                passing.unlink(missing_ok=True)
        return os.open(passing, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)

    def drop_spares(self) -> None:
        """Remove the spare part files no new part was written over."""
        spares, self._spares = self._spares, {}
        for path in itertools.chain.from_iterable(spares.values()):
            path.unlink(missing_ok=True)

    def drop_new(self) -> None:
        """The last snapshot is not kept: the parts it made are not written, and it names
        none."""
        for part, _ in self._new:
            self._parts = {k: p for k, p in self._parts.items() if p is not part}
        self._new, self._named = [], {}
        self.drop_spares()

    def remove_unnamed(self, kept: set[str], recycle: bool = False) -> None:
        """Remove this rank's part files that no kept snapshot names; with ``recycle``,
        keep them as spares for the parts written next (``write_new``), but those this
        rank loaded."""
        assert self.folder is not None
        prefix = f"rank{self.rank}-part"
        for path in self.folder.glob(f"{prefix}*.bin"):
            if path.name in kept:
                continue
            try:
                nbytes = path.stat().st_size
            except OSError:
                continue
            if recycle and path.name not in self.mapped and nbytes >= PART_MIN:
                self._spares.setdefault(nbytes, []).append(path)
            else:
                path.unlink(missing_ok=True)
        self._parts = {k: p for k, p in self._parts.items() if p.path.name in kept}
