"""Where every rank is: Python stacks taken from live ranks, without stopping them.

A rank asks ``faulthandler`` to dump every thread's stack to a file of its own on
``SIGUSR2``. faulthandler writes from C inside the signal handler, so it answers even
while the rank's main thread waits in a collective that holds no Python lock. The kernel
sends the signal, waits for the dump and renders it (``_run/stack_view.py``); the rank
also names its main thread, where the user's code runs.
"""

from __future__ import annotations

import faulthandler
import re
import signal
import threading
import time
from pathlib import Path
from typing import IO

STACKS_SIGNAL = signal.SIGUSR2
STACKS_WAIT = 2.0
"""Seconds a rank has to answer (faulthandler answers in milliseconds, even when busy)."""
_MAIN = "main thread "


def answer_stacks(path: Path) -> IO[str]:
    """In a rank: dump every thread's stack to ``path`` on ``STACKS_SIGNAL``. The file
    stays open for the process's life (faulthandler writes to its descriptor)."""
    stacks = open(path, "a")  # noqa: SIM115 - it must outlive this call
    stacks.write(f"{_MAIN}0x{threading.main_thread().ident or 0:016x}\n")
    stacks.flush()
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True, chain=False)
    return stacks


def read_dump(path: Path, since: int, wait: float) -> str | None:
    """The dump written to ``path`` after byte ``since``, once it stopped growing; None
    if none came within ``wait`` seconds."""
    deadline = time.monotonic() + wait
    last = -1
    while time.monotonic() < deadline:
        size = size_of(path)
        if size > since and size == last:
            with open(path, "rb") as f:
                f.seek(since)
                return f.read().decode(errors="replace")
        last = size
        time.sleep(0.05)
    return None


def size_of(path: Path) -> int:
    """Bytes in ``path`` so far (0 if it is not there yet)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def main_thread_id(path: Path) -> str | None:
    """The rank's main thread, as faulthandler names it: the last one a rank wrote when
    it started (a rank torchrun restarted appends its own)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    found = re.findall(rf"^{_MAIN}(0x[0-9a-f]+)$", text, re.MULTILINE)
    return found[-1] if found else None
