"""The authenticated link between the ranks and the kernel, and the messages on it.

The kernel listens on a Unix socket inside the run's private (0700) directory, or, for
ranks on other machines (a SLURM job), on a TCP port. Both ends prove they hold the
run's random key (HMAC challenge in each direction) before anything else is read, so a
stranger's connection is dropped and changes nothing. Frames are a 4-byte length and a
pickled message; only authenticated peers are read.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import pickle
import queue
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

KEY_BYTES = 32
_HANDSHAKE_TIMEOUT = 10.0
_HEADER = struct.Struct("!I")


# --- messages -------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """A rank is up and connected."""

    rank: int
    pid: int


@dataclass(frozen=True)
class Result:
    """A rank finished; ``value`` is its pickled return value when the kernel wants it."""

    rank: int
    value: bytes | None = None


@dataclass(frozen=True)
class Failure:
    """A rank raised. ``exception`` is the pickled exception when it could be pickled."""

    rank: int
    type_name: str
    module: str
    message: str
    traceback: str
    exception: bytes | None = None
    time: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Metrics:
    """A batch of one rank's ``nbddp.log`` records and its ``nbddp.progress`` position."""

    rank: int
    records: list[tuple[int, dict[str, float]]]
    position: tuple[int, int | None, str | None] | None = None


@dataclass(frozen=True)
class Sequenced:
    """A rank's message and its place in that rank's stream. A rank may send each
    message on two links (socket and mailbox file); the kernel keeps the first copy."""

    seq: int
    message: Any

    @property
    def rank(self) -> int:
        return self.message.rank


@dataclass(frozen=True)
class Disconnected:
    """Kernel-side event: a rank's connection closed."""

    rank: int


# --- authentication and framing -------------------------------------------------------


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def _digest(key: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, challenge, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, remaining = [], n
    while remaining:
        chunk = sock.recv(remaining)
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _authenticate(sock: socket.socket, key: bytes) -> None:
    """Mutual challenge-response; raises ConnectionError unless the peer has ``key``."""
    mine = secrets.token_bytes(KEY_BYTES)
    sock.sendall(mine)
    theirs = _recv_exact(sock, KEY_BYTES)
    sock.sendall(_digest(key, theirs))
    if not hmac.compare_digest(_recv_exact(sock, KEY_BYTES), _digest(key, mine)):
        raise ConnectionError("peer does not hold the run's key")


def send_message(sock: socket.socket, message: Any) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(body)) + body)


def recv_message(sock: socket.socket) -> Any:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return pickle.loads(_recv_exact(sock, size))


# --- kernel side ----------------------------------------------------------------------


Address = Path | tuple[str, int]
"""A Unix socket's path, or a TCP (host, port)."""


def _new_socket(address: Address) -> tuple[socket.socket, str | tuple[str, int]]:
    """A stream socket for ``address``, and the address in the form ``socket`` takes."""
    if isinstance(address, Path):
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), str(address)
    return socket.socket(socket.AF_INET, socket.SOCK_STREAM), address


class ChannelServer:
    """Accepts authenticated rank connections and puts their messages on ``events``.

    ``address`` is a socket path, or a TCP (host, port) to bind (port 0: any free one;
    ``port`` says which).
    """

    def __init__(self, address: Address, key: bytes, events: queue.Queue) -> None:
        self.address, self._key, self._events = address, key, events
        self._listener, where = _new_socket(address)
        self._listener.bind(where)
        if isinstance(address, Path):
            os.chmod(address, 0o600)
        self.port: int | None = None if isinstance(address, Path) else \
            self._listener.getsockname()[1]
        self._listener.listen(64)
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._accepter = threading.Thread(target=self._accept_loop, daemon=True,
                                          name="nbddp-channel-accept")
        self._accepter.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # listener closed
            threading.Thread(target=self._serve, args=(sock,), daemon=True,
                             name="nbddp-channel-reader").start()

    def _serve(self, sock: socket.socket) -> None:
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._connections.add(sock)
        rank = None
        try:
            sock.settimeout(_HANDSHAKE_TIMEOUT)
            _authenticate(sock, self._key)
            sock.settimeout(None)
            while True:
                message = recv_message(sock)
                rank = getattr(message, "rank", rank)
                self._events.put(message)
        except (OSError, ConnectionError, EOFError, pickle.UnpicklingError) as exc:
            logger.debug("channel connection ended: %r", exc)
        finally:
            with self._lock:
                self._connections.discard(sock)
            sock.close()
            if rank is not None:
                self._events.put(Disconnected(rank))

    def close(self) -> None:
        """Stop listening, drop every connection and remove the socket file."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        for sock in [self._listener, *connections]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._accepter.join(timeout=5)
        if isinstance(self.address, Path):
            self.address.unlink(missing_ok=True)


# --- rank side ------------------------------------------------------------------------


class ChannelClient:
    """A rank's authenticated connection to the kernel; ``send`` is thread-safe."""

    def __init__(self, address: Address, key: bytes) -> None:
        self._sock, where = _new_socket(address)
        self._sock.settimeout(_HANDSHAKE_TIMEOUT)
        self._sock.connect(where)
        _authenticate(self._sock, key)
        self._sock.settimeout(None)
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        with self._lock:
            send_message(self._sock, message)

    def wait_closed(self) -> None:
        """Block until the kernel closes the connection (or it breaks)."""
        try:
            while self._sock.recv(4096):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self._sock.close()
