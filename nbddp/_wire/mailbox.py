"""Messages through files, for ranks that cannot (or can no longer) reach the kernel.

A SLURM job's ranks run on other machines, and a kernel may sit on a login node that
they cannot connect to, or restart while the job runs. So each rank also appends every
message to its own file in the run folder, which lives on the shared filesystem: the
kernel polls those files, and a kernel that re-attaches reads them from the start. The
folder is private (0700), like the channel's key.

Each message is one frame: a marker, the body's length and CRC-32, the pickled message.
A rank killed while writing leaves a torn frame, and a requeued (or restarted) attempt
appends after it; the reader then skips to the next marker that starts a whole frame,
warns once, and reads on. The checksum is for integrity, not authentication: only the
user can write the file. The file is read while the rank still appends to it, so a
frame that is not whole yet is waited for: it is torn only once a whole frame follows
it, and skipped only if it still looks torn a moment later (a shared filesystem may show
a later write before an earlier one that was not forced to disk), or when the run is over.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .frames import decode, pickled
from .messages import Failure, Requeueing, Result, Sequenced
from .rundir import mailbox_name

logger = logging.getLogger(__name__)

POLL_INTERVAL = 0.2
TORN_GRACE = 1.0  # seconds a frame may look torn before it is skipped
MARKER = b"\x89nbddp\r\n"
_HEAD = struct.Struct("!8sQI")  # the marker, the body's length, its CRC-32
_REPORTS = (Result, Failure, Requeueing)


def mailbox_path(folder: Path, rank: int) -> Path:
    return folder / mailbox_name(rank)


def frame(message: Any) -> bytes:
    """One mailbox frame: the marker, the body's length and CRC-32, the pickled message."""
    body = pickled(message)
    return _HEAD.pack(MARKER, len(body), zlib.crc32(body)) + body


def _whole_at(data: bytes, at: int) -> bytes | None:
    """The body of the whole, intact frame that starts at ``at``, or None."""
    if len(data) - at < _HEAD.size:
        return None
    marker, length, crc = _HEAD.unpack_from(data, at)
    end = at + _HEAD.size + length
    if marker != MARKER or end > len(data):
        return None
    body = data[at + _HEAD.size:end]
    return body if zlib.crc32(body) == crc else None


def _next_whole(data: bytes, start: int) -> int | None:
    """Where the first whole frame at or after ``start`` begins, if one does."""
    at = data.find(MARKER, start)
    while at >= 0 and _whole_at(data, at) is None:
        at = data.find(MARKER, at + 1)
    return at if at >= 0 else None


def split(data: bytes) -> tuple[list[bytes], int, int | None]:
    """The bodies of the whole frames at the start of ``data``, the bytes they use, and
    the length of the torn span that stops them, if one does: bytes that are not a whole
    frame, followed by one. Bytes that no whole frame follows may be a frame still being
    written: the read stops before them, with no torn span."""
    bodies: list[bytes] = []
    at = 0
    while (body := _whole_at(data, at)) is not None:
        bodies.append(body)
        at += _HEAD.size + len(body)
    after = _next_whole(data, at + 1) if at < len(data) else None
    return bodies, at, None if after is None else after - at


def needs_sync(message: Any) -> bool:
    """Is ``message`` a report (a rank's result, failure or requeue)? The kernel must
    see those however the rank or its machine ends, so they are on disk before the rank
    goes on (and, with them, everything written before). Metrics and stats, about ten a
    second per rank, are not forced: each fsync is a round trip to the shared
    filesystem's servers, a load on them at scale."""
    inner = message.message if isinstance(message, Sequenced) else message
    return isinstance(inner, _REPORTS)


class MailboxWriter:
    """One rank's message file; a report is on disk (fsync) when ``send`` returns, so a
    reader on another machine sees it, and all before it, however the rank ends."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def send(self, message: Any) -> None:
        data = memoryview(frame(message))
        while data:
            data = data[os.write(self._fd, data):]
        if needs_sync(message):
            os.fsync(self._fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


class MailboxReader:
    """Polls every rank's message file and hands each whole message to ``deliver``."""

    def __init__(self, folder: Path, nprocs: int, deliver: Callable[[Any], None]) -> None:
        self._paths = [mailbox_path(folder, rank) for rank in range(nprocs)]
        self._offsets = [0] * nprocs
        self._torn: dict[int, tuple[int, float]] = {}  # rank: (offset, first seen torn)
        self._deliver = deliver
        self._lock = threading.Lock()  # the poll thread and the supervisor both read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="nbddp-mailbox")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(POLL_INTERVAL):
            self.poll()

    def poll(self, final: bool = False) -> None:
        """Read what every rank has appended since the last poll; ``final``: the ranks
        are gone, so what looks torn is skipped at once."""
        with self._lock:
            for rank, path in enumerate(self._paths):
                for message in self._read(rank, path, final):
                    self._deliver(message)

    def _read(self, rank: int, path: Path, final: bool) -> list[Any]:
        try:  # opened afresh each time: on NFS, an open is what shows new data
            with open(path, "rb") as f:
                f.seek(self._offsets[rank])
                data = f.read()
        except FileNotFoundError:
            return []
        messages: list[Any] = []
        while True:
            bodies, used, torn = split(data)
            messages.extend(self._decode(bodies, path))
            self._offsets[rank] += used
            if torn is None or not self._skip(rank, torn, path, final):
                return messages
            self._offsets[rank] += torn
            data = data[used + torn:]

    def _skip(self, rank: int, length: int, path: Path, final: bool) -> bool:
        """Skip the torn span at the rank's offset? Once it has looked torn for
        ``TORN_GRACE`` seconds, or at once when ``final``; warns when it does."""
        offset, now = self._offsets[rank], time.monotonic()
        seen = self._torn.get(rank)
        if seen is None or seen[0] != offset:
            self._torn[rank] = seen = (offset, now)
        if not final and now - seen[1] < TORN_GRACE:
            return False
        del self._torn[rank]
        logger.warning("nbddp: skipped %d bytes at offset %d of %s that are not a whole "
                       "message (a rank stopped while writing it); read on from the next",
                       length, offset, path)
        return True

    @staticmethod
    def _decode(bodies: list[bytes], path: Path) -> list[Any]:
        messages = []
        for body in bodies:
            try:
                messages.append(decode(body))
            except Exception:  # a frame we cannot read is skipped, not fatal
                logger.warning("nbddp: skipped an unreadable message in %s", path)
        return messages

    def close(self) -> None:
        """Stop polling, after one last read of what the ranks wrote."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll(final=True)
