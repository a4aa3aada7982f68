"""The system calls a cell makes before its ranks have it, made holding the interpreter
lock (``_wire.held_calls``): each does what its ``os``/``socket`` twin does, errors
included, and no other thread runs in between."""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import pytest

from nbddp._wire import held_calls

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


def test_pread_reads_a_proc_file_as_os_does():
    fd = os.open("/proc/self/statm", os.O_RDONLY)
    try:
        ours, theirs = held_calls.pread(fd, 256, 0), os.pread(fd, 256, 0)
        assert ours.split()[:1] and len(ours.split()) == len(theirs.split()) == 7
        assert held_calls.pread(fd, 256, len(ours)) == b""  # (past the end: nothing)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as raised:
        held_calls.pread(fd, 256, 0)  # closed
    assert raised.value.errno == errno.EBADF


def test_send_all_sends_a_message_larger_than_the_socket_holds_whole():
    sender, receiver = socket.socketpair()
    data = os.urandom(8 * 2**20)  # more than a socket buffer: the rest waits for room
    got = bytearray()

    def read() -> None:
        while len(got) < len(data):
            got.extend(receiver.recv(2**20))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        held_calls.send_all(sender, data)
        reader.join(timeout=30)
        assert bytes(got) == data
    finally:
        sender.close()
        receiver.close()


def test_send_all_to_a_closed_peer_or_socket_raises():
    sender, receiver = socket.socketpair()
    receiver.close()
    with pytest.raises(OSError) as raised:
        held_calls.send_all(sender, b"x" * 100)
    assert raised.value.errno in (errno.EPIPE, errno.ECONNRESET)
    sender.close()
    with pytest.raises(OSError):
        held_calls.send_all(sender, b"x")


def test_recv_ready_takes_what_has_arrived_and_never_waits():
    sender, receiver = socket.socketpair()
    try:
        assert held_calls.recv_ready(receiver, 4096) is None  # (nothing yet: no wait)
        for data, size in ((b"a frame" * 1000, 4096), (os.urandom(100_000), 150_000)):
            sender.sendall(data)  # (then a larger read than the last: a larger buffer)
            got = b""
            while len(got) < len(data):
                got += held_calls.recv_ready(receiver, size) or b""
            assert got == data
        sender.close()
        assert held_calls.recv_ready(receiver, 4096) == b""  # the peer closed
    finally:
        receiver.close()
    with pytest.raises(OSError):
        held_calls.recv_ready(receiver, 4096)


def test_getcwd_and_exists_answer_as_os_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert held_calls.getcwd() == os.getcwd()
    (tmp_path / "there").write_text("")
    assert held_calls.exists(str(tmp_path / "there"))
    assert not held_calls.exists(str(tmp_path / "not there"))
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(FileNotFoundError):
        held_calls.getcwd()


def _ticks_during(read: Callable[[int, int, int], bytes], path: str) -> int:
    """How often another thread ticked (once a millisecond, when it can) while ``read``
    read 96 MB of a file's hole (zeroes, no disk: a tenth of a second or more)."""
    size = 96 * 2**20
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    ticks = [0]
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.001):
            ticks[0] += 1

    ticker = threading.Thread(target=tick)
    ticker.start()
    interval = sys.getswitchinterval()
    try:
        while ticks[0] < 2:  # (ticking)
            time.sleep(0.001)
        sys.setswitchinterval(1.0)  # (no thread is made to let go of the lock meanwhile)
        before = ticks[0]
        assert len(read(fd, size, 0)) == size
        return ticks[0] - before
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        ticker.join()
        os.close(fd)


def test_no_other_thread_runs_during_a_held_call(tmp_path):
    """In a Jupyter kernel, IPython's history thread and ipykernel's I/O thread wait for
    the lock as a cell begins: each call that lets it go may hand them the interpreter
    before the ranks have the cell. (A long read stands for it here: the calls made this
    way take microseconds.)"""
    hole = str(tmp_path / "hole")
    assert _ticks_during(os.pread, hole) > 5  # (the other thread ticks meanwhile)
    assert _ticks_during(held_calls.pread, hole) <= 1
