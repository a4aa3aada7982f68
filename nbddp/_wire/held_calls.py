"""A few quick system calls made without letting go of Python's interpreter lock.

Every call in ``os`` and ``socket`` lets the lock go while the kernel works, so that other
threads run meanwhile. In a Jupyter kernel, as a cell begins, other threads are waiting
for it: IPython's history thread saves the cell, ipykernel's I/O thread sends its
messages. Each call that lets the lock go hands them the interpreter, and the cell's
thread gets it back only when they block again: many times what the ``pread`` or
``send`` itself takes (benchmarks/README.md says by how much). A session's cell makes a
handful before its ranks have it (a look at each rank's process, the working directory,
a Start to each rank), so a real share of a quick cell went to other threads' work,
which could as well run while the ranks run the cell.

The same goes for the kernel's thread that reads the ranks' reports as a cell ends:
each ``recv`` that lets the lock go hands it to those threads (whose turn came while
the cell's thread held it), and the reports wait until they give it back.

These make the same calls through ``ctypes.PyDLL``, which keeps the lock: only calls
that do not wait (a ``/proc`` file, a send that takes what the socket has room for and
leaves the rest to ``socket.sendall``, a receive of what has arrived, the working
directory, a path's existence, which on a network file system may wait for its
server).
Where the C library cannot be loaded this way, they are the ``os`` and ``socket`` calls.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import socket
import threading
from typing import Any

_NO_WAIT = (socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)
            if hasattr(socket, "MSG_DONTWAIT") else 0)
"""A send's flags: never wait for room (and no SIGPIPE); 0 where a send cannot be told
not to wait (then ``sendall`` sends it all)."""
_RECV_NO_WAIT = getattr(socket, "MSG_DONTWAIT", 0)
"""A receive's flag: never wait for data; 0 where a receive cannot be told so (then it
is the socket's own call)."""
_PATH_MAX = 4096


@functools.cache
def _libc() -> Any:
    """The C library's calls, declared; None where it cannot be loaded this way."""
    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        calls = (libc.pread, libc.send, libc.recv, libc.getcwd, libc.access)
    except (OSError, AttributeError, TypeError):  # (TypeError: no C library by None)
        return None
    pread, send, recv, getcwd, access = calls
    pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    pread.restype = ctypes.c_ssize_t
    send.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    send.restype = ctypes.c_ssize_t
    recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    recv.restype = ctypes.c_ssize_t
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


_buffers = threading.local()  # (each reading thread's own)


def recv_ready(sock: socket.socket, size: int) -> bytes | None:
    """``sock.recv(size, MSG_DONTWAIT)``: up to ``size`` bytes of what has arrived (``b""``:
    the peer closed), or None if nothing has (``BlockingIOError``, for the socket call)."""
    libc = _libc()
    if libc is None or not _RECV_NO_WAIT:
        try:
            return sock.recv(size, _RECV_NO_WAIT)
        except (BlockingIOError, InterruptedError):
            return None
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = _buffers.buffer = ctypes.create_string_buffer(size)
    got = libc.recv(sock.fileno(), buffer, size, _RECV_NO_WAIT)
    if got < 0:
        if ctypes.get_errno() in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
            return None
        raise _error()
    return ctypes.string_at(buffer, got)


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
