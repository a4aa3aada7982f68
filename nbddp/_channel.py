"""The authenticated link between the ranks and the kernel, in both directions.

The kernel listens on a Unix socket inside the run's private (0700) directory, or, for
ranks on other machines (a SLURM job), on a TCP port. Both ends prove they hold the
run's random key (HMAC challenge in each direction) before anything else is read, so a
stranger's connection is dropped and changes nothing. Ranks send their messages; the
kernel sends a rank its ``Start``. Frames are those of ``_messages``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import pickle
import secrets
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._messages import HEADER_SIZE, Disconnected, body_size, decode, encode

logger = logging.getLogger(__name__)

KEY_BYTES = 32
_HANDSHAKE_TIMEOUT = 10.0


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def _digest(key: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, challenge, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, remaining = [], n
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
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


def recv_message(sock: socket.socket) -> Any:
    return decode(_recv_exact(sock, body_size(_recv_exact(sock, HEADER_SIZE))))


Address = Path | tuple[str, int]
"""A Unix socket's path, or a TCP (host, port)."""


def _new_socket(address: Address) -> tuple[socket.socket, str | tuple[str, int]]:
    """A stream socket for ``address``, and the address in the form ``socket`` takes."""
    if isinstance(address, Path):
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), str(address)
    return socket.socket(socket.AF_INET, socket.SOCK_STREAM), address


# --- kernel side ----------------------------------------------------------------------


class ChannelServer:
    """Accepts authenticated rank connections, hands each message to ``deliver``, and
    sends messages to a rank once it has spoken (its first message names its rank).

    ``address`` is a socket path, or a TCP (host, port) to bind (port 0: any free one;
    ``port`` says which). A rank's closed connection is delivered as ``Disconnected``.
    """

    def __init__(self, address: Address, key: bytes, deliver: Callable[[Any], None]) -> None:
        self.address, self._key, self._deliver = address, key, deliver
        self._listener, where = _new_socket(address)
        self._listener.bind(where)
        if isinstance(address, Path):
            os.chmod(address, 0o600)
        self.port: int | None = None if isinstance(address, Path) else \
            self._listener.getsockname()[1]
        self._listener.listen(64)
        self._connections: set[socket.socket] = set()
        self._peers: dict[int, socket.socket] = {}
        self._send_locks: dict[socket.socket, threading.Lock] = {}
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
        attempt = requeue = 0
        try:
            sock.settimeout(_HANDSHAKE_TIMEOUT)
            _authenticate(sock, self._key)
            sock.settimeout(None)
            while True:
                message = recv_message(sock)
                if rank is None and hasattr(message, "rank"):
                    rank = self._register(message.rank, sock)
                    attempt = getattr(message, "attempt", 0)
                    requeue = getattr(message, "requeue", 0)
                self._deliver(message)
        except (OSError, ConnectionError, EOFError, pickle.UnpicklingError) as exc:
            logger.debug("channel connection ended: %r", exc)
        finally:
            self._forget(sock, rank)
            if rank is not None:
                self._deliver(Disconnected(rank, attempt, requeue))

    def _register(self, rank: int, sock: socket.socket) -> int:
        with self._lock:
            self._peers[rank] = sock
            self._send_locks[sock] = threading.Lock()
        return rank

    def _forget(self, sock: socket.socket, rank: int | None) -> None:
        with self._lock:
            self._connections.discard(sock)
            if rank is not None and self._peers.get(rank) is sock:
                del self._peers[rank]
            self._send_locks.pop(sock, None)
        sock.close()

    def send(self, rank: int, message: Any) -> bool:
        """Send ``message`` to ``rank``; False if that rank is not connected (any more)."""
        with self._lock:
            sock = self._peers.get(rank)
            lock = self._send_locks.get(sock) if sock is not None else None
        if sock is None or lock is None:
            return False
        try:
            with lock:
                sock.sendall(encode(message))
        except OSError:
            return False
        return True

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
    """A rank's authenticated connection to the kernel; ``send`` is thread-safe, and
    one thread at a time may ``receive``."""

    def __init__(self, address: Address, key: bytes) -> None:
        self._sock, where = _new_socket(address)
        self._sock.settimeout(_HANDSHAKE_TIMEOUT)
        self._sock.connect(where)
        _authenticate(self._sock, key)
        self._sock.settimeout(None)
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        with self._lock:
            self._sock.sendall(encode(message))

    def receive(self) -> Any:
        """The kernel's next message; ConnectionError once the kernel has closed the link."""
        try:
            return recv_message(self._sock)
        except OSError as exc:
            raise ConnectionError(f"the kernel's link broke: {exc}") from exc

    def close(self) -> None:
        self._sock.close()
