"""Memory files for the kernel's kept copies of tensors: new ones, or the files of
released copies that no process maps any more, written over.

Most of the cost of a fresh copy is the system providing its pages (on a virtual
machine that has handed freed memory back to its host, several times the copy itself).
A released copy's file still holds its pages. Where no process maps it (a rank that
kept a name from an earlier cell does; a one-off launch's ranks have exited), nothing
can read it any more, so the next copy is written into it: the copy alone, at memory
speed.

Only processes this kernel started (its ranks, their workers) ever map its files, and
only through a payload that holds the copy: a file is kept as a spare once its copy is
released and none of them has it in its memory map. Spares stay within a budget that
their owner sets (during one send, the bytes of the copies it keeps; else none), and
are closed when it shrinks.
"""

from __future__ import annotations

import contextlib
import os
import threading

from .processes import descendants

MAX_SPARES = 4
"""Released files kept at most."""


class MemoryFiles:
    """Memory files, new or recycled; ``release`` gives one back when its copy goes."""

    def __init__(self) -> None:
        self._spares: list[tuple[int, int]] = []  # (descriptor, size), oldest first
        self._budget = 0
        self._lock = threading.RLock()  # (a copy released by the collector re-enters)

    def new(self, nbytes: int) -> int:
        """A file of ``nbytes`` (its descriptor): a spare where there is one (the
        smallest large enough, else the largest), else a new one. OSError where memory
        is short."""
        with self._lock:
            spare = self._pick(nbytes)
        fd = os.memfd_create("nbddp-tensor", os.MFD_CLOEXEC) if spare is None else spare
        try:
            os.fchmod(fd, 0o400)  # (ranks open it to read; the kernel writes through fd)
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)  # (ENOSPC now, not SIGBUS in a rank later)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def release(self, fd: int, nbytes: int, reuse: list[bool]) -> None:
        """``fd``'s copy is gone: keep the file as a spare if ``reuse[0]`` (a next copy
        of its tensor is likely: it changed), no process maps it and the budget has
        room; else close it. (A finalizer calls this: it never raises.)"""
        try:
            if reuse[0] and self._has_room(nbytes) and not mapped_anywhere(os.fstat(fd).st_ino):
                with self._lock:
                    if self._has_room(nbytes):  # (still: a send may have ended meanwhile)
                        self._spares.append((fd, nbytes))
                        return
        except Exception:  # noqa: BLE001 - the file is closed below, whatever failed
            pass
        with contextlib.suppress(OSError):
            os.close(fd)

    def _has_room(self, nbytes: int) -> bool:
        with self._lock:
            return (len(self._spares) < MAX_SPARES
                    and self._spare_bytes() + nbytes <= self._budget)

    def budget(self, nbytes: int) -> None:
        """Keep at most ``nbytes`` of spares (closing the oldest beyond)."""
        closing = []
        with self._lock:
            self._budget = nbytes
            while self._spares and self._spare_bytes() > nbytes:
                closing.append(self._spares.pop(0)[0])
        for fd in closing:
            os.close(fd)

    def spares(self) -> list[int]:
        """The spares' sizes, oldest first."""
        with self._lock:
            return [size for _, size in self._spares]

    def _pick(self, nbytes: int) -> int | None:
        """(Under the lock) The spare to write ``nbytes`` into, taken off the list."""
        if not self._spares:
            return None
        fits = [spare for spare in self._spares if spare[1] >= nbytes]
        chosen = min(fits, key=lambda s: s[1]) if fits else max(self._spares,
                                                                 key=lambda s: s[1])
        self._spares.remove(chosen)
        return chosen[0]

    def _spare_bytes(self) -> int:
        return sum(size for _, size in self._spares)


def mapped_anywhere(inode: int) -> bool:
    """This process or one it started (at any depth) maps the memory file ``inode``;
    True also where a process's map cannot be read (it is not known not to)."""
    for pid in (os.getpid(), *descendants(os.getpid())):
        try:
            with open(f"/proc/{pid}/maps", "rb") as maps:
                if any(_maps_memory_file(line, inode) for line in maps):
                    return True
        except FileNotFoundError:  # it ended meanwhile: it maps nothing
            continue
        except OSError:
            return True
    return False


def _maps_memory_file(line: bytes, inode: int) -> bool:
    fields = line.split(maxsplit=5)
    return len(fields) == 6 and fields[4] == b"%d" % inode and fields[5].startswith(b"/memfd:")
