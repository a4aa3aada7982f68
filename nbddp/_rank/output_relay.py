"""A rank's output, sent to the kernel, from a node that shares no filesystem with it.

A rank writes its output (Python's and C's) to a log file, and the kernel reads that
file in the run's records. On a Ray node the records are not there: the rank's log stays
in the node's run dir, and ``OutputRelay`` sends what is new in it every
``RELAY_EVERY`` seconds as ``OutputBytes``, which the kernel appends to the rank's log
in the records (so the panel, ``.logs`` and the run's records read it as ever). Before a
rank reports how a run ended it sends the rest (``flush``): the run's last lines reach
the kernel before its end does.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._wire.messages import OutputBytes

RELAY_EVERY = 0.05
"""Seconds between two looks at the log for new output (live output's latency)."""
MAX_CHUNK = 1 << 20
"""At most this many bytes in one message (a rank that prints a lot sends several)."""


class OutputRelay:
    """Rank ``rank``'s output in ``log``, sent with ``send`` (see the module's docstring)."""

    def __init__(self, rank: int, log: Path, send: Callable[[Any], None]) -> None:
        self.rank, self.log, self._send = rank, log, send
        self._sent = 0  # bytes of the log sent so far
        self._lock = threading.Lock()
        self._following = False

    def move(self, old: Path, new: Path) -> None:
        """The rank's log would move to the run's records (``new``, on the kernel's
        machine): it stays here, and what it says goes to the kernel from now on."""
        if not self._following:
            self._following = True
            threading.Thread(target=self._follow, daemon=True, name="nbddp-output").start()

    def _follow(self) -> None:
        while True:
            time.sleep(RELAY_EVERY)
            with contextlib.suppress(OSError):
                self.flush()

    def flush(self) -> None:
        """Send what the log has that was not sent yet."""
        sys.stdout.flush()
        sys.stderr.flush()
        with self._lock, open(self.log, "rb") as log:
            log.seek(self._sent)
            while chunk := log.read(MAX_CHUNK):
                self._send(OutputBytes(self.rank, chunk))
                self._sent += len(chunk)
