"""Where every rank is: Python stacks taken from live ranks, without stopping them.

A rank asks ``faulthandler`` to dump every thread's stack to a file of its own on
``SIGUSR2``. faulthandler writes from C inside the signal handler, so it answers even
while the rank's main thread waits in a collective that holds no Python lock, or holds
the GIL in native code. The kernel signals a rank on its own machine, waits for the dump
(whole: the main thread's block comes last) and renders it (``_run/stack_view.py``). A
rank on another machine is asked over the channel and dumps from its link's thread. The
rank also names its main thread, where the user's code runs.
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


_STEADY = 6
"""Polls (0.05 s apart) without growth after which a dump is taken as it is, even if the
main thread's block has not come (faulthandler writes it last: it is the oldest)."""


def read_dump(path: Path, since: int, wait: float, main: str | None = None) -> str | None:
    """The dump written to ``path`` after byte ``since``: once the main thread's (``main``)
    block is whole, or once it stopped growing; None if none came within ``wait`` seconds.
    (A rank that loses the CPU while faulthandler writes pauses mid-dump: a dump that
    merely paused is not taken for whole.)"""
    deadline = time.monotonic() + wait
    last, steady = -1, 0
    while time.monotonic() < deadline:
        size = size_of(path)
        steady = steady + 1 if size == last and size > since else 0
        last = size
        if steady:
            text = _read_from(path, since)
            if steady >= _STEADY or (main is not None and main_is_whole(text, main)):
                return text
        time.sleep(0.05)
    return _read_from(path, since) if last > since else None


def _read_from(path: Path, since: int) -> str:
    with open(path, "rb") as f:
        f.seek(since)
        return f.read().decode(errors="replace")


def main_is_whole(text: str, main: str | None) -> bool:
    """The main thread's block is there down to the rank's entry frame (``python -m``);
    True where the main thread is not known."""
    if main is None:
        return True
    start = max(text.rfind(f"Thread {main}"), text.rfind(f"Current thread {main}"))
    return start >= 0 and "_run_module_as_main" in text[start:]


def dump_now(path: Path) -> str:
    """In a rank: every thread's stack, dumped now from this thread (the kernel asked over
    the channel) and kept in ``path`` too."""
    since = size_of(path)
    with open(path, "a") as stacks:
        faulthandler.dump_traceback(file=stacks, all_threads=True)
    return _read_from(path, since)


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
