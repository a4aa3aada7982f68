"""Data files across machines: a payload to each node, a result back, over the channel.

Ranks on another machine cannot map the kernel's shared memory, so a data file
(``_wire.dataplane``: a pickle and its tensor and array bytes) crosses the channel as
raw bytes into a file on the receiving machine, in its shared memory where it fits,
which its processes then map as they would a local one.

Every frame of the channel is sealed by a MAC of its connection, so sending one file to
several nodes would hash it once per node on the kernel. Instead the file's pieces are
hashed once (SHA-256, on every core, while the bytes already go out), and the digests
follow the bytes in a sealed frame::

    FileFollows(size, pieces, message)    a sealed frame
    the pieces' raw bytes                 in order, nothing between them
    FileSeal(digests)                     a sealed frame: each piece's SHA-256

The receiver writes the bytes into a new private file while it hashes them, and trusts
the file only once the seal (which only a holder of the key can make) matches every
piece; until then nothing in it is read, let alone unpickled. A forged, altered or
reordered byte fails the check, and the connection closes.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .dataplane import Packed, layout, place, write_at

PIECE = 8 * 2**20
"""Bytes per hashed piece: small enough to hash while the next one moves."""
_CHUNK = 512 * 2**10
"""Bytes a receiver reads, hashes and writes at once: they stay in the CPU's cache."""
_RING = 4
_HASHERS = max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class FileFollows:
    """The raw bytes of a data file of ``size`` bytes follow this frame, piece by piece
    (``pieces``: each one's offset and length, in the order sent), then a ``FileSeal``.
    ``message`` names the file: the receiver hands it on with its ``file`` set to where
    the file landed."""

    size: int
    pieces: tuple[tuple[int, int], ...]
    message: Any


@dataclass(frozen=True)
class FileSeal:
    """Each piece's SHA-256, in order: sealed like every frame, so only a holder of the
    key can vouch for the bytes before it."""

    digests: tuple[bytes, ...]


class Outgoing:
    """A data file to send, to one machine or several: its pieces, hashed once, in the
    background, from the moment it is made."""

    def __init__(self, packed: Packed) -> None:
        size, spans = layout(packed)
        self._begin(size, spans, packed.owners)

    @classmethod
    def of_file(cls, path: Path) -> Outgoing:
        """A data file already on this machine, sent on as it is (a node's relay passes
        a rank's result on to the kernel this way)."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mapped: Any = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) if size else b""
        outgoing = cls.__new__(cls)
        outgoing._begin(size, [(0, memoryview(mapped))], mapped)
        return outgoing

    def _begin(self, size: int, spans: list[tuple[int, memoryview]], owners: Any) -> None:
        """Cut ``spans`` (offset, bytes) into pieces, and start hashing them."""
        self.size = size
        self.pieces = [(offset + start, view[start:start + PIECE])
                       for offset, view in spans
                       for start in range(0, view.nbytes, PIECE)]
        self._owners = owners  # the tensors' memory stays while this is sent
        pool = ThreadPoolExecutor(_HASHERS, thread_name_prefix="nbddp-hash")
        self._digests: list[Future[bytes]] = [pool.submit(_sha256, view)
                                              for _, view in self.pieces]
        pool.shutdown(wait=False)

    def announce(self, message: Any) -> FileFollows:
        return FileFollows(self.size, tuple((offset, view.nbytes)
                                            for offset, view in self.pieces), message)

    def views(self) -> Iterator[memoryview]:
        for _, view in self.pieces:
            yield view

    def seal(self) -> FileSeal:
        """The digests (waiting for those still being computed)."""
        return FileSeal(tuple(digest.result() for digest in self._digests))


def _sha256(view: memoryview) -> bytes:
    return hashlib.sha256(view).digest()  # (releases the GIL: pieces hash in parallel)


Inbox = Callable[[int], Path]
"""Where a received file of so many bytes goes: a folder of this machine (the file is
made private, under a name nobody can guess, and never through a link)."""


class Incoming:
    """A file being received: each piece read off the socket in cache-sized chunks, each
    chunk hashed and written to a new private file in the inbox while it is still in the
    CPU's cache. (Writing, not mapping: mapping fresh shared memory costs a fault per
    page, and a full ``/dev/shm`` then kills with SIGBUS instead of saying so.)"""

    def __init__(self, announced: FileFollows, inbox: Inbox) -> None:
        _check_pieces(announced)
        self.announced = announced
        self.path: Path | None = None
        self._fd: int | None = None
        self._digests: tuple[bytes, ...] = ()
        with contextlib.suppress(OSError):
            self.path, self._fd = _new_file(inbox(announced.size))

    def receive(self, sock: Readable) -> None:
        """Read every piece off ``sock`` into the file (or, with no room for it, read and
        dropped: the frames after it must still be found). A second thread hashes each
        chunk while this one reads and writes the next (a ring of ``_RING`` chunks)."""
        ring = [memoryview(bytearray(_CHUNK)) for _ in range(_RING)]
        pending: list[Future[None] | None] = [None] * _RING
        digests: list[Future[bytes]] = []
        turn = 0
        with ThreadPoolExecutor(1, thread_name_prefix="nbddp-check") as hasher:
            for offset, length in self.announced.pieces:
                digest = hashlib.sha256()
                for start in range(0, length, _CHUNK):
                    slot = turn % _RING
                    turn += 1
                    hashing = pending[slot]
                    if hashing is not None:
                        hashing.result()  # (its last chunk is hashed: reuse it)
                    view = ring[slot][:min(_CHUNK, length - start)]
                    _recv_into(sock, view)
                    pending[slot] = hasher.submit(digest.update, view)
                    self._write(view, offset + start)
                digests.append(hasher.submit(digest.digest))
        self._digests = tuple(digest.result() for digest in digests)
        if self._fd is not None:
            os.ftruncate(self._fd, self.announced.size)  # (zeros after the last piece)

    def _write(self, view: memoryview, offset: int) -> None:
        if self._fd is None:
            return
        try:
            write_at(self._fd, view, offset)
        except OSError:  # no room (ENOSPC): the rest is read and dropped
            self.discard()

    def accept(self, seal: Any) -> Path | None:
        """The file, once ``seal`` vouches for every piece; None where there was no room.
        ConnectionError (and no file) if a piece does not match."""
        if not isinstance(seal, FileSeal) or seal.digests != self._digests:
            self.discard()
            raise ConnectionError("a data file failed its authentication check")
        self._close()
        return self.path

    def discard(self) -> None:
        self._close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _check_pieces(announced: FileFollows) -> None:
    """Pieces within the file and no larger than a piece (the frame is sealed: this
    guards against a sender's bug, not an attacker)."""
    for offset, length in announced.pieces:
        if offset < 0 or length < 0 or length > PIECE or offset + length > announced.size:
            raise ConnectionError("a data file's pieces do not fit its size")


class Readable(Protocol):
    """Where a data file's bytes are read from: a socket, or a link's read-ahead."""

    def recv_into(self, view: memoryview) -> int: ...


def _recv_into(sock: Readable, view: memoryview) -> None:
    done = 0
    while done < view.nbytes:
        got = sock.recv_into(view[done:])
        if not got:
            raise ConnectionError("connection closed")
        done += got


def copy_into(source: Path, inbox: Inbox) -> Path:
    """A private copy of the data file ``source`` (another machine's, on a shared
    filesystem) in ``inbox``, copied by the kernel (``sendfile``); OSError if there is no
    room for it (and then no partial copy stays)."""
    with open(source, "rb") as src:
        size = os.fstat(src.fileno()).st_size
        path, fd = _new_file(inbox(size))
        try:
            done = 0
            while done < size:
                sent = os.sendfile(fd, src.fileno(), done, size - done)
                if not sent:
                    raise OSError(f"{source} ended early")
                done += sent
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
    return path


def _new_file(folder: Path) -> tuple[Path, int]:
    """A new 0600 file in ``folder``, open for writing, under a name nobody can guess (the
    folder may be a machine's ``/dev/shm`` itself, where anyone may write), never through
    a link."""
    path = folder / f"nbddp-in-{secrets.token_hex(8)}.data"
    return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)


def place_in(shm: Path | None, disk: Path) -> Inbox:
    """An inbox: ``shm`` where a file fits there (and leaves its margin), else ``disk``."""
    return lambda size: place(size, disk, shm)
