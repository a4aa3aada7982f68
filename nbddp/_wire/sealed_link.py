"""An authenticated connection, once its handshake is done (``_wire.handshake``): whole
messages both ways, each frame sealed and numbered.

Every frame (``_wire.frames``) is followed by an HMAC under a key of this connection and
direction, over the frame and its sequence number: a frame injected, altered, replayed or
reordered on the way fails its check and closes the connection before it is unpickled. (A
Unix socket in a private directory needs none of this; one code path for both transports
keeps it simple, and costs microseconds a message.)

A message may take a data file along (a cluster session's payload to a node, a result
back): its bulk bytes go raw between two sealed frames, the second of which vouches for
them (``_wire.transfer``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import pickle
import socket
import threading
import time
from typing import Any

from .frames import HEADER_SIZE, body_size, decode, encode
from .transfer import FileFollows, Inbox, Incoming, Outgoing

MAC_BYTES = 32  # HMAC-SHA256
_READ_AHEAD = 64 * 2**10  # bytes a link reads at once when it needs more
_send_all = socket.socket.sendall  # (a test sends frames in pieces through it)


def seal(key: bytes, label: bytes, *parts: bytes | memoryview) -> bytes:
    """The MAC under ``key`` of ``label`` (what the MAC is for) and then ``parts``."""
    mac = hmac.new(key, label + b"\0", hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


def recv_exact(sock: socket.socket | _Reader, n: int) -> bytes:
    chunks, remaining = [], n
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


class _Reader:
    """A socket's incoming bytes, read ahead: a small frame's header, body and check come
    in one system call, and frames that arrived together are read at once. Large reads (a
    data file's pieces) go straight into their buffer once what was read ahead is used."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._ahead = bytearray()

    def recv(self, n: int) -> bytes:
        """Up to ``n`` bytes (``b""``: the peer closed)."""
        if not self._ahead:
            if n >= _READ_AHEAD:
                return self._sock.recv(n)
            self._ahead += self._sock.recv(_READ_AHEAD)
        taken = bytes(self._ahead[:n])
        del self._ahead[:n]
        return taken

    def recv_into(self, view: memoryview) -> int:
        """Fill up to ``len(view)`` bytes of ``view``; how many (0: the peer closed)."""
        if not self._ahead:
            return self._sock.recv_into(view)
        n = min(len(view), len(self._ahead))
        view[:n] = self._ahead[:n]
        del self._ahead[:n]
        return n


class SealedLink:
    """An authenticated connection: whole messages, each frame sealed by a MAC under
    this connection's key for its direction and numbered, so none can be forged,
    altered, replayed or reordered. ``send`` is thread-safe; one thread ``receive``s.

    A message may carry a data file (``_wire.transfer``): it arrives with its ``file``
    naming where the file landed here, in the ``inbox`` (a link without one refuses
    files)."""

    def __init__(self, sock: socket.socket, send_key: bytes, receive_key: bytes) -> None:
        self.sock = sock
        self._reader = _Reader(sock)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            _tune_tcp(sock)
        self._send_key, self._receive_key = send_key, receive_key
        self._sent = self._received = 0
        self._send_lock = threading.Lock()
        self.heard = time.monotonic()  # when a frame last came (its peer answers)
        self._pending = bytearray()  # (take_ready's: the start of a frame still coming)
        self.inbox: Inbox | None = None

    def send(self, message: Any, data: Outgoing | None = None) -> None:
        """Send ``message``; with ``data``, the data file it names goes along."""
        with self._send_lock:
            if data is None:
                self._send_frame(encode(message))
                return
            self._send_frame(encode(data.announce(message)))
            for view in data.views():
                self.sock.sendall(view)
            self._send_frame(encode(data.seal()))

    def send_encoded(self, frame: bytes) -> None:
        """Send a message already ``encode``d (once, for many links)."""
        with self._send_lock:
            self._send_frame(frame)

    def _send_frame(self, frame: bytes) -> None:
        """(Under the send lock.) A message's ``encode``d frame, sealed."""
        tag = seal(self._send_key, b"frame", self._sent.to_bytes(8, "big"), frame)
        self._sent += 1
        _send_all(self.sock, frame + tag)

    def receive(self) -> Any:
        """The next message; ConnectionError if the link closed or a frame was forged."""
        message = self._receive_frame()
        if isinstance(message, FileFollows):
            return self._receive_file(message)
        return message

    def _receive_file(self, announced: FileFollows) -> Any:
        """The message a data file came with, its ``file`` set to where it landed (``""``:
        this machine had no room for it)."""
        if self.inbox is None:
            raise ConnectionError("a data file came on a link that takes none")
        incoming = Incoming(announced, self.inbox)
        try:
            incoming.receive(self._reader)
            path = incoming.accept(self._receive_frame())
        except BaseException:
            incoming.discard()
            raise
        return _with_file(announced.message, str(path) if path is not None else "")

    def take_ready(self) -> tuple[list[Any], str | None]:
        """The messages whose frames have arrived whole, read without waiting (for a
        link that one thread reads among many: ``_wire.read_loop``), and why the link is over
        after them, if it is: the peer closed, a frame failed its check (nothing from it
        on is unpickled), or a data file came, which such a link does not take."""
        try:
            data = _recv_ready(self.sock, _READ_AHEAD)  # (None: a spurious wake-up)
        except OSError as exc:
            return [], f"the connection broke: {exc}"
        if data is not None:
            self._pending += data
        messages: list[Any] = []
        while len(self._pending) >= HEADER_SIZE:
            end = HEADER_SIZE + body_size(bytes(self._pending[:HEADER_SIZE])) + MAC_BYTES
            if len(self._pending) < end:
                break
            frame = memoryview(self._pending)[:end]
            try:
                message = self._checked(frame[:HEADER_SIZE], frame[HEADER_SIZE:-MAC_BYTES],
                                        frame[-MAC_BYTES:])
            except (ConnectionError, EOFError, pickle.UnpicklingError) as exc:
                return messages, str(exc)
            finally:
                frame.release()
            del self._pending[:end]
            if isinstance(message, FileFollows):
                return messages, "a data file came on a link that takes none"
            messages.append(message)
        return messages, "closed" if data == b"" else None

    def _checked(self, header: bytes | memoryview, body: memoryview,
                 tag: memoryview) -> Any:
        """The message in a frame, once its check holds (numbered: none may be dropped,
        replayed or reordered)."""
        expected = seal(self._receive_key, b"frame", self._received.to_bytes(8, "big"),
                        header, body)
        if not hmac.compare_digest(tag, expected):
            raise ConnectionError("a frame failed its authentication check")
        self._received += 1
        self.heard = time.monotonic()
        return decode(body)

    def _receive_frame(self) -> Any:
        header = recv_exact(self._reader, HEADER_SIZE)
        sealed = memoryview(recv_exact(self._reader, body_size(header) + MAC_BYTES))
        return self._checked(header, sealed[:-MAC_BYTES], sealed[-MAC_BYTES:])


def _with_file(message: Any, file: str) -> Any:
    """``message`` (or the one it wraps: a ``Sequenced``'s, a relay's ``ForRank`` or
    ``FromRank``) naming ``file``."""
    if hasattr(message, "file"):
        return dataclasses.replace(message, file=file)
    inner = getattr(message, "message", None)
    if inner is None or isinstance(inner, (str, bytes)):
        raise ConnectionError(f"a data file came with a {type(message).__name__}")
    return dataclasses.replace(message, message=_with_file(inner, file))


def _tune_tcp(sock: socket.socket) -> None:
    """A small frame goes at once, not 40 ms later (Nagle's algorithm and delayed ACKs);
    a peer whose machine vanished is noticed within minutes (keepalive), not never."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _recv_ready(sock: socket.socket, size: int) -> bytes | None:
    """Up to ``size`` bytes of what has arrived, without waiting (``b""``: the peer
    closed); None if nothing has."""
    try:
        return sock.recv(size, socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
