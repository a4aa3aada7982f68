"""Messages through files, for ranks that cannot (or can no longer) reach the kernel.

A SLURM job's ranks run on other machines, and a kernel may sit on a login node that
they cannot connect to, or restart while the job runs. So each rank also appends every
message to its own file in the run folder, which lives on the shared filesystem: the
kernel polls those files, and a kernel that re-attaches reads them from the start. The
folder is private (0700), like the channel's key. Frames are those of ``_messages``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._messages import Failure, Requeueing, Result, Sequenced, decode, encode, split_frames

logger = logging.getLogger(__name__)

POLL_INTERVAL = 0.2
_REPORTS = (Result, Failure, Requeueing)


def mailbox_path(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank}.messages"


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
        os.write(self._fd, encode(message))
        if needs_sync(message):
            os.fsync(self._fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


class MailboxReader:
    """Polls every rank's message file and hands each complete message to ``deliver``."""

    def __init__(self, folder: Path, nprocs: int, deliver: Callable[[Any], None]) -> None:
        self._paths = [mailbox_path(folder, rank) for rank in range(nprocs)]
        self._offsets = [0] * nprocs
        self._deliver = deliver
        self._lock = threading.Lock()  # the poll thread and the supervisor both read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="nbddp-mailbox")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(POLL_INTERVAL):
            self.poll()

    def poll(self) -> None:
        """Read what every rank has appended since the last poll."""
        with self._lock:
            for rank, path in enumerate(self._paths):
                for message in self._read(rank, path):
                    self._deliver(message)

    def _read(self, rank: int, path: Path) -> list[Any]:
        try:  # opened afresh each time: on NFS, an open is what shows new data
            with open(path, "rb") as f:
                f.seek(self._offsets[rank])
                data = f.read()
        except FileNotFoundError:
            return []
        bodies, used = split_frames(data)
        self._offsets[rank] += used
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
        self.poll()
