"""A few quick system calls made without letting go of Python's interpreter lock.

Every call in ``os`` and ``socket`` lets the lock go while the kernel works, so that other
threads run meanwhile. In a Jupyter kernel, as a cell begins, other threads are waiting
for it: IPython's history thread saves the cell, ipykernel's I/O thread sends its
messages. Each call that lets the lock go hands them the interpreter, and the cell's
thread gets it back only when they block again: 50 to 250 µs for a ``pread`` or a
``send`` that takes the system 2, measured in a real kernel. A session's cell makes a
handful before its ranks have it (a look at each rank's process, the working directory,
a Start to each rank), so half a millisecond went to other threads' work, which could
as well run while the ranks run the cell.

These make the same calls through ``ctypes.PyDLL``, which keeps the lock: only calls
that do not wait (a ``/proc`` file, a send that takes what the socket has room for and
leaves the rest to ``socket.sendall``, the working directory, a path's existence, which
on a network file system may wait for its server).
Where the C library cannot be loaded this way, they are the ``os`` and ``socket`` calls.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import socket
from typing import Any

_NO_WAIT = (socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)
            if hasattr(socket, "MSG_DONTWAIT") else 0)
"""A send's flags: never wait for room (and no SIGPIPE); 0 where a send cannot be told
not to wait (then ``sendall`` sends it all)."""
_PATH_MAX = 4096


@functools.cache
def _libc() -> Any:
    """The C library's calls, declared; None where it cannot be loaded this way."""
    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        calls = (libc.pread, libc.send, libc.getcwd, libc.access)
    except (OSError, AttributeError, TypeError):  # (TypeError: no C library by None)
        return None
    pread, send, getcwd, access = calls
    pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    pread.restype = ctypes.c_ssize_t
    send.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    send.restype = ctypes.c_ssize_t
    getcwd.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    getcwd.restype = ctypes.c_char_p
    access.argtypes = [ctypes.c_char_p, ctypes.c_int]
    access.restype = ctypes.c_int
    return libc


def _error() -> OSError:
    code = ctypes.get_errno()
    return OSError(code, os.strerror(code))


def pread(fd: int, size: int, offset: int) -> bytes:
    """``os.pread``, for a file that answers at once (``/proc``)."""
    libc = _libc()
    if libc is None:
        return os.pread(fd, size, offset)
    buffer = ctypes.create_string_buffer(size)
    got = libc.pread(fd, buffer, size, offset)
    while got < 0 and ctypes.get_errno() == errno.EINTR:  # (as os.pread retries)
        got = libc.pread(fd, buffer, size, offset)
    if got < 0:
        raise _error()
    return buffer.raw[:got]


def send_all(sock: socket.socket, data: bytes) -> None:
    """``sock.sendall(data)``: what the socket has room for at once is sent holding the
    lock (all of a small message), the rest by ``sendall``, which waits for room."""
    libc = _libc()
    sent = 0
    if libc is not None and _NO_WAIT:
        sent = libc.send(sock.fileno(), data, len(data), _NO_WAIT)
        if sent == len(data):
            return
        if sent < 0:
            if ctypes.get_errno() not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                raise _error()
            sent = 0
    sock.sendall(memoryview(data)[sent:] if sent else data)


def getcwd() -> str:
    """``os.getcwd()``."""
    libc = _libc()
    if libc is None:
        return os.getcwd()
    buffer = ctypes.create_string_buffer(_PATH_MAX)
    if libc.getcwd(buffer, _PATH_MAX) is None:
        return os.getcwd()  # (removed, or longer than PATH_MAX: its error, as os says it)
    return os.fsdecode(buffer.value)


def exists(path: str) -> bool:
    """``os.path.exists(path)``. (On a network file system the answer may take a round
    trip to its server: the cell's thread waits for it either way, the others then too.)"""
    libc = _libc()
    if libc is None:
        return os.path.exists(path)
    return libc.access(os.fsencode(path), os.F_OK) == 0
