"""Tensor and array bytes out of band: written once to a file, mapped by the receiver.

What crosses between the kernel and the ranks is pickled with protocol 5. The bytes of
CPU tensors (``torch``) and NumPy arrays leave the pickle as out-of-band buffers; a
``Packed`` object is the pickle and those buffers. ``write`` puts both in one file,
each buffer page-aligned; ``read`` maps that file copy-on-write (``MAP_PRIVATE``), so
the receiver's tensors and arrays use its pages without a copy, are writable, and a
write changes the writer's copy only. The mapping stays valid after the file is gone.

Files go to shared memory (``/dev/shm``) when it has room, and to the run directory
otherwise (Docker's 64 MB ``/dev/shm``); ``NBDDP_SHM_DIR`` names another place, or
``""`` for none. Tensors share storages as they did: views come back as views (how
tensors are pickled is ``_wire.tensor_pickler``'s).

Writing into fresh shared memory costs the kernel's allocation of every page as much as
the copy itself; a ``Room`` allocates the next payload's pages ahead, while nothing waits.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import pickle
import shutil
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .tensor_pickler import Kept, TensorPickler

if TYPE_CHECKING:
    from .shipped_code import CodeSent

OUT_OF_BAND_MIN = 64 * 1024
"""Buffers smaller than this stay in the pickle (a file is not worth it)."""
SHM_MARGIN = 256 * 2**20
"""Room left free in shared memory after a file is written there."""
_PAGE = mmap.PAGESIZE
_MAGIC = b"NBDDP-1\0"
_HEAD = struct.Struct("<8sQQ")  # magic, pickle length, buffer count
_SPAN = struct.Struct("<QQ")  # a buffer's offset and length
_CHUNK = 1 << 30  # bytes per write call (Linux writes at most about 2 GiB at once)


@dataclass
class Packed:
    """A pickle, and the buffers it left out of band."""

    data: bytes
    buffers: list[Any] = field(default_factory=list)
    owners: list[Any] = field(default_factory=list, repr=False)
    """What the buffers' memory belongs to (tensor storages), kept alive with them."""
    code_files: frozenset[str] = frozenset()
    """The files (notebook cells) of the code the pickle carries by value."""
    code_names: frozenset[str] = frozenset()
    """The names the code the pickle carries by value uses (its imports among them)."""
    code: CodeSent | None = None
    """The user's module files this payload carries, for which ranks (``shipped_code``)."""

    @property
    def buffer_bytes(self) -> int:
        return sum(memoryview(b).nbytes for b in self.buffers)

    def load(self) -> Any:
        return pickle.loads(self.data, buffers=self.buffers)


def pack(value: Any, to_cpu: bool = False, out_of_band: bool = True,
         kept: Kept | None = None) -> Packed:
    """Pickle ``value`` (cloudpickle, protocol 5), tensor and array bytes out of band
    (unless ``out_of_band`` is false); ``to_cpu`` moves device tensors to the CPU first
    (for the kernel, which has no GPU). Large tensors' storages go by their ``kept``
    copies, where given (for ranks on this machine): made now, or still current."""
    buffers: list[Any] = []

    def keep(buffer: pickle.PickleBuffer) -> bool:
        if not out_of_band or buffer.raw().nbytes < OUT_OF_BAND_MIN:
            return True  # in band
        buffers.append(buffer)
        return False

    stream = io.BytesIO()
    pickler = TensorPickler(stream, to_cpu, keep, kept)
    with contextlib.nullcontext() if kept is None else kept.sending():
        pickler.dump(value)
    return Packed(stream.getvalue(), buffers, list(pickler.storages.values()),
                  frozenset(pickler.code_files), frozenset(pickler.code_names))


# --- files ----------------------------------------------------------------------------


def layout(packed: Packed) -> tuple[int, list[tuple[int, memoryview]]]:
    """How ``packed`` lies in its file: the file's size, and each part's offset and bytes
    (the header with the pickle first, then each buffer, page-aligned; zeros between)."""
    raws = raw_buffers(packed)
    start = _HEAD.size + _SPAN.size * len(raws) + len(packed.data)
    spans = []
    for raw in raws:
        start = -(-start // _PAGE) * _PAGE
        spans.append((start, raw.nbytes))
        start += raw.nbytes
    header = _HEAD.pack(_MAGIC, len(packed.data), len(raws)) + b"".join(
        _SPAN.pack(*span) for span in spans)
    parts = [(0, memoryview(header + packed.data))]
    parts += [(offset, raw) for raw, (offset, _) in zip(raws, spans, strict=True)]
    return start, parts


def raw_buffers(packed: Packed) -> list[memoryview]:
    """Each of ``packed``'s buffers as flat bytes, without a copy."""
    return [memoryview(b).cast("B") if not isinstance(b, pickle.PickleBuffer)
            else b.raw() for b in packed.buffers]


def write(path: Path, packed: Packed, room: Path | None = None) -> None:
    """One private (0600) file: a header, the pickle, then each buffer page-aligned.
    ``room`` (a file allocated ahead, of any size), if it is still there, becomes that
    file: its pages are reused and it is cut or grown to size."""
    size, parts = layout(packed)
    fd = _take_room(room, path) if room is not None else None
    if fd is None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        for offset, part in parts:
            write_at(fd, part, offset)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def _take_room(room: Path, path: Path) -> int | None:
    """``room`` renamed to ``path`` and opened, or None if it is not there (any more)."""
    try:
        os.rename(room, path)
    except FileNotFoundError:
        return None
    return os.open(path, os.O_WRONLY)


def write_at(fd: int, data: memoryview, offset: int) -> None:
    """All of ``data`` into ``fd`` at ``offset`` (OSError, e.g. ENOSPC, if it cannot)."""
    done = 0
    while done < data.nbytes:
        done += os.pwrite(fd, data[done:done + _CHUNK], offset + done)


def size_of(packed: Packed) -> int:
    """About the size of ``packed``'s file (for choosing where it goes)."""
    return len(packed.data) + packed.buffer_bytes + _PAGE * (len(packed.buffers) + 1)


def read(path: Path) -> Packed:
    """The packed object in ``path``, its buffers mapped copy-on-write from the file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
    if mapped is None:
        raise ValueError(f"{path} is empty")
    view = memoryview(mapped)
    magic, length, count = _HEAD.unpack_from(view, 0)
    if magic != _MAGIC:
        raise ValueError(f"{path} is not an nbddp data file")
    spans = [_SPAN.unpack_from(view, _HEAD.size + i * _SPAN.size) for i in range(count)]
    start = _HEAD.size + _SPAN.size * count
    data = bytes(view[start:start + length])
    return Packed(data, [view[offset:offset + n] for offset, n in spans])


def place(size: int, fallback: Path, shm: Path | None) -> Path:
    """Where a file of ``size`` bytes goes: ``shm`` if it has room, else ``fallback``."""
    return shm if shm is not None and fits(size, shm) else fallback


def fits(size: int, folder: Path) -> bool:
    """``folder`` has room for ``size`` more bytes, and the margin beside them."""
    try:
        return shutil.disk_usage(folder).free >= size + SHM_MARGIN
    except OSError:
        return False


def shm_root() -> Path | None:
    """The shared-memory directory to use, if any (``NBDDP_SHM_DIR`` overrides)."""
    configured = os.environ.get("NBDDP_SHM_DIR")
    root = Path(configured) if configured else Path("/dev/shm") if configured is None else None
    if root is None or not (root.is_dir() and os.access(root, os.W_OK | os.X_OK)):
        return None
    return root


PAYLOAD_ROOM = "room-payload"
"""The name of the room for a group's next payload, in its run dir's shared-memory twin."""
RESULT_ROOM = "room-result"
"""The name of the room for the next result; the first rank to return takes it."""


class Room:
    """Shared memory allocated ahead, in the background, for the next file of about
    ``nbytes`` (only where it fits): it appears at ``path`` once allocated, and ``write``
    takes it over."""

    MIN = 16 * 2**20
    """Smaller files are written fast enough without."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        self._thread = threading.Thread(target=self._allocate, args=(nbytes,), daemon=True,
                                        name="nbddp-room")
        self._thread.start()

    def _allocate(self, nbytes: int) -> None:
        if not fits(nbytes, self.path.parent):
            return
        part = self.path.with_name(self.path.name + ".part")
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:  # the folder is gone: its group ended first
            return
        try:
            os.posix_fallocate(fd, 0, nbytes)
            os.rename(part, self.path)  # whole, or not there
        except OSError:
            part.unlink(missing_ok=True)
        finally:
            os.close(fd)

    def take(self) -> Path | None:
        """The allocated file, once allocation has finished; None where it was not made
        (or another process took it)."""
        self._thread.join()
        return self.path if self.path.exists() else None

    def discard(self) -> None:
        self._thread.join()
        self.path.unlink(missing_ok=True)
