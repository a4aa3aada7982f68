"""The authenticated link between the ranks and the kernel, in both directions.

The kernel listens on a Unix socket inside the run's private (0700) directory, or, for
ranks on other machines (a SLURM job), on a TCP port of the address the ranks are told
to use. Either way the only secret is the run's random key (a 0600 file), and a peer
must prove it holds the key before anything it sends is unpickled.

The handshake keeps the order of ``multiprocessing.connection``'s
``deliver_challenge``/``answer_challenge``, with HMAC-SHA256: the kernel proves nothing
until the rank has proved itself, so a stranger cannot use the kernel to answer the
kernel's own challenge::

    kernel -> rank    MAGIC, kernel nonce
    rank -> kernel    rank nonce, HMAC(key, "rank" | kernel nonce | rank nonce)
    kernel            checks it; a wrong answer closes the connection, nothing more is said
    kernel -> rank    HMAC(key, "kernel" | kernel nonce | rank nonce)
    rank              checks it

Both nonces are fresh on every connection, so a recorded handshake cannot be replayed.
Every frame after it (a ``_wire.messages`` frame) is followed by an HMAC under a key of this
connection and direction, over the frame and its sequence number: a frame injected,
altered, replayed or reordered on the way fails its check and closes the connection
before it is unpickled. (A Unix socket in a private directory needs none of this; one
code path for both transports keeps it simple, and costs microseconds a message.)

A message may take a data file along (a cluster session's payload to a node, a result
back): its bulk bytes go raw between two sealed frames, the second of which vouches for
them (``_wire.transfer``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import logging
import os
import pickle
import queue
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from . import held_calls
from .frames import HEADER_SIZE, body_size, decode, encode
from .messages import Disconnected
from .relay_messages import ForRank, FromRank, FromRanks, HeadListens, JoinTree, ToRanks, TreePlace
from .relay_tree import RelayTree
from .transfer import FileFollows, Inbox, Incoming, Outgoing

logger = logging.getLogger(__name__)

KEY_BYTES = 32
NONCE_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256
MAGIC = b"nbddp-channel/2\n"
"""The kernel's first bytes: a rank connected to something else fails at once."""
_HANDSHAKE_TIMEOUT = 10.0
_READ_AHEAD = 64 * 2**10  # bytes a link reads at once when it needs more


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def _mac(key: bytes, label: bytes, *parts: bytes | memoryview) -> bytes:
    return _sealed(_keyed(key, label), *parts)


def _keyed(key: bytes, label: bytes) -> hmac.HMAC:
    """The MAC of ``label`` under ``key``, to be continued (a copy per message)."""
    return hmac.new(key, label + b"\0", hashlib.sha256)


def _sealed(keyed: hmac.HMAC, *parts: bytes | memoryview) -> bytes:
    """``keyed``'s MAC continued with ``parts`` (``keyed`` is left as it was). A copy of
    a keyed MAC costs half of a new one: OpenSSL looks its digest up at each ``new``,
    and every message of every link is sealed and checked once each."""
    mac = keyed.copy()
    for part in parts:
        mac.update(part)
    return mac.digest()


def _recv_exact(sock: socket.socket | _Reader, n: int) -> bytes:
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


class _Link:
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
        self._sealing = _keyed(send_key, b"frame")
        self._checking = _keyed(receive_key, b"frame")
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
        tag = _sealed(self._sealing, self._sent.to_bytes(8, "big"), frame)
        self._sent += 1
        held_calls.send_all(self.sock, frame + tag)

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
        link that one thread reads among many: ``_ReadLoop``), and why the link is over
        after them, if it is: the peer closed, a frame failed its check (nothing from it
        on is unpickled), or a data file came, which such a link does not take."""
        try:
            data = held_calls.recv_ready(self.sock, _READ_AHEAD)  # (None: a spurious wake-up)
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
        expected = _sealed(self._checking, self._received.to_bytes(8, "big"), header, body)
        if not hmac.compare_digest(tag, expected):
            raise ConnectionError("a frame failed its authentication check")
        self._received += 1
        self.heard = time.monotonic()
        return decode(body)

    def _receive_frame(self) -> Any:
        header = _recv_exact(self._reader, HEADER_SIZE)
        sealed = memoryview(_recv_exact(self._reader, body_size(header) + MAC_BYTES))
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


def _keys(key: bytes, kernel_nonce: bytes, rank_nonce: bytes) -> tuple[bytes, bytes]:
    """This connection's frame keys: (rank to kernel, kernel to rank)."""
    return (_mac(key, b"rank->kernel", kernel_nonce, rank_nonce),
            _mac(key, b"kernel->rank", kernel_nonce, rank_nonce))


def _challenge_rank(sock: socket.socket, key: bytes) -> _Link:
    """The kernel's half of the handshake: check the rank's proof, then give its own."""
    kernel_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + kernel_nonce)
    reply = _recv_exact(sock, NONCE_BYTES + MAC_BYTES)
    rank_nonce, proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(key, b"rank", kernel_nonce, rank_nonce)):
        raise ConnectionError("peer does not hold the run's key")
    sock.sendall(_mac(key, b"kernel", kernel_nonce, rank_nonce))
    from_rank, to_rank = _keys(key, kernel_nonce, rank_nonce)
    return _Link(sock, send_key=to_rank, receive_key=from_rank)


def _answer_kernel(sock: socket.socket, key: bytes) -> _Link:
    """A rank's half of the handshake: prove it holds the key, then check the kernel."""
    hello = _recv_exact(sock, len(MAGIC) + NONCE_BYTES)
    if not hello.startswith(MAGIC):
        raise ConnectionError("the address does not lead to an nbddp kernel")
    kernel_nonce = hello[len(MAGIC):]
    rank_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(rank_nonce + _mac(key, b"rank", kernel_nonce, rank_nonce))
    try:
        proof = _recv_exact(sock, MAC_BYTES)
    except ConnectionError as exc:
        raise ConnectionError("the kernel refused this rank's proof: its key is not the "
                              "run's key") from exc
    if not hmac.compare_digest(proof, _mac(key, b"kernel", kernel_nonce, rank_nonce)):
        raise ConnectionError("the kernel's end does not hold the run's key")
    from_rank, to_rank = _keys(key, kernel_nonce, rank_nonce)
    return _Link(sock, send_key=from_rank, receive_key=to_rank)


Address = Path | tuple[str, int]
"""A Unix socket's path, or a TCP (host, port)."""


def tcp_address(host: str) -> str:
    """The IP address ``host`` names here: the kernel listens there alone (not on every
    interface) and tells the ranks to connect to it. IPv4 first, as ranks resolve it."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConnectionError(f"cannot resolve the kernel's host name {host!r}: {exc}") \
            from exc
    found.sort(key=lambda entry: entry[0] != socket.AF_INET)
    return str(found[0][4][0])


def _new_socket(address: Address) -> tuple[socket.socket, str | tuple[str, int]]:
    """A stream socket for ``address``, and the address in the form ``socket`` takes."""
    if isinstance(address, Path):
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), str(address)
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    return socket.socket(family, socket.SOCK_STREAM), address


# --- kernel side ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Route:
    """How the kernel reaches a rank: its own connection, or its node's relay's; and
    which attempt it was (for the ``Disconnected`` its connection's end makes)."""

    link: _Link
    relayed: bool = False
    attempt: int = 0
    requeue: int = 0



class _FanOut:
    """How a set of ranks is reached: per link, the ranks it reaches (in order), which of
    those links are relays' (a frame to them names its ranks: ``ToRanks``), and the
    ranks not connected."""

    def __init__(self, routes: list[tuple[int, _Route | None]]) -> None:
        by_link: dict[_Link, list[int]] = {}
        self.relays: set[_Link] = set()
        self.missed: set[int] = set()
        for rank, route in routes:
            if route is None:
                self.missed.add(rank)
                continue
            by_link.setdefault(route.link, []).append(rank)
            if route.relayed:
                self.relays.add(route.link)
        self.links = [(link, tuple(sorted(on_link))) for link, on_link in by_link.items()]


class _Peer:
    """A connection's state in the kernel: its link once the handshake is done, and the
    ranks that spoke through it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.link: _Link | None = None
        self.spoke: dict[int, _Route] = {}


class _ReadLoop:
    """One thread reading every connection that brings no data file: whichever has whole
    frames, their messages go to ``handle``; a connection that closes, or whose frame
    fails its check, to ``end``. (A thread per connection costs the kernel a wake-up and
    a turn of the interpreter lock per message: with a connection per node of a large
    cluster, most of its time.)

    Nothing escapes the loop: a callback that raises ends its own connection and no
    other, so one bad message cannot leave every rank unheard."""

    def __init__(self, handle: Callable[[_Peer, Any], None],
                 end: Callable[[_Peer], None]) -> None:
        self._handle, self._end = handle, end
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake = socket.socketpair()
        self._wake_read.setblocking(False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._added: queue.SimpleQueue[_Peer] = queue.SimpleQueue()
        self._adding = threading.Lock()  # (an add and the loop's end: one or the other)
        self._closed = self._stopped = False
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="nbddp-channel-reads")
        self._thread.start()

    def add(self, peer: _Peer) -> None:
        """Read ``peer`` from now on (its handshake is done); after ``close``, it is ended
        at once (its connection was shut down with the others)."""
        with self._adding:
            if not self._stopped:
                self._added.put(peer)
                self._wake_up()
                return
        self._finish(peer, "the channel was closed")

    def _wake_up(self) -> None:
        with contextlib.suppress(OSError):  # (full: a wake-up is pending anyway)
            self._wake.send(b"x", socket.MSG_DONTWAIT)

    def _loop(self) -> None:
        while not self._may_stop():
            for key, _ in self._selector.select():
                if key.data is None:
                    self._take_added()
                else:
                    self._read(key.data)
        self._selector.close()
        self._wake_read.close()
        self._wake.close()  # (an add from now on ends its peer at once: nothing wakes)

    def _may_stop(self) -> bool:
        """Closed, and every connection read to its end: then no more are added."""
        if not self._closed or any(key.data for key in self._selector.get_map().values()):
            return False
        with self._adding:
            if not self._added.empty():
                return False
            self._stopped = True
            return True

    def _take_added(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_read.recv(4096):
                pass
        while True:
            try:
                peer = self._added.get_nowait()
            except queue.Empty:
                return
            try:
                self._selector.register(peer.sock, selectors.EVENT_READ, peer)
            except (OSError, ValueError) as exc:  # (closed meanwhile)
                self._finish(peer, f"the connection broke: {exc}")
                continue
            self._read(peer)  # (what came before it was registered)

    def _read(self, peer: _Peer) -> None:
        assert peer.link is not None
        messages, over = peer.link.take_ready()
        try:
            for message in messages:
                self._handle(peer, message)
        except Exception:  # noqa: BLE001 - one connection's trouble stops no other
            logger.exception("a message from a rank could not be taken")
            over = "a message could not be taken"
        if over is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(peer.sock)
            self._finish(peer, over)

    def _finish(self, peer: _Peer, why: str) -> None:
        logger.debug("channel connection ended: %s", why)
        try:
            self._end(peer)
        except Exception:  # noqa: BLE001 - as in _read
            logger.exception("the end of a rank's connection could not be taken")

    def close(self) -> None:
        """Stop once every connection has ended (the server has shut them down); from the
        loop's own thread (a callback that closes the channel), it stops after this turn."""
        self._closed = True
        self._wake_up()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)


class ChannelServer:
    """Accepts authenticated rank connections, hands each message to ``deliver``, and
    sends messages to a rank once it has spoken (its first message names its rank).

    ``address`` is a socket path, or a TCP (host, port) to bind (port 0: any free one;
    ``port`` says which). Each connection's handshake has a thread of its own, so one
    that says nothing holds up no other (and is dropped after the handshake timeout);
    then one thread reads them all (``_ReadLoop``), or, where ranks may send data files,
    its own thread each.
    A rank's closed connection is delivered as ``Disconnected``. With an ``inbox``,
    ranks may send data files (``_wire.transfer``): they land there. With a ``tree``, the
    nodes' relays ask it for their place (``_wire.relay_tree``); without, each stays.
    """

    def __init__(self, address: Address, key: bytes, deliver: Callable[[Any], None],
                 inbox: Inbox | None = None, tree: RelayTree | None = None) -> None:
        self.address, self._key, self._deliver = address, key, deliver
        self._inbox, self._tree = inbox, tree
        self._listener, where = _new_socket(address)
        self._listener.bind(where)
        if isinstance(address, Path):
            os.chmod(address, 0o600)
        self.port: int | None = None if isinstance(address, Path) else \
            self._listener.getsockname()[1]
        self._listener.listen(64)
        self._connections: set[socket.socket] = set()
        self._peers: dict[int, _Route] = {}
        self._fan_out: tuple[tuple[int, ...], _FanOut] | None = None
        """(Under the lock) The last fan-out asked for, until a route changes."""
        self._lock = threading.Lock()
        self._closed = False
        self._reads = _ReadLoop(self._handle, self._end)
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
        """A new connection: its handshake, then its messages, read here if it may bring
        data files (they take a while), by the read loop with every other one if not."""
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._connections.add(sock)
        peer = _Peer(sock)
        try:
            sock.settimeout(_HANDSHAKE_TIMEOUT)
            peer.link = _challenge_rank(sock, self._key)
            peer.link.inbox = self._inbox
            sock.settimeout(None)
            if self._inbox is None:
                self._reads.add(peer)
                return
            while True:
                self._handle(peer, peer.link.receive())
        except (OSError, ConnectionError, EOFError, pickle.UnpicklingError) as exc:
            logger.debug("channel connection ended: %r", exc)
        self._end(peer)

    def _handle(self, peer: _Peer, message: Any) -> None:
        assert peer.link is not None
        if isinstance(message, FromRanks):  # a node's relay: its ranks' batch
            for each in message.messages:
                self._take(each, peer.link, peer.spoke, relayed=True)
        elif isinstance(message, FromRank):  # ... and one's message with a data file
            self._take(message.message, peer.link, peer.spoke, relayed=True)
        elif isinstance(message, (JoinTree, HeadListens)):
            self._place(peer.link, message)
        else:
            self._take(message, peer.link, peer.spoke, relayed=False)

    def _place(self, link: _Link, message: JoinTree | HeadListens) -> None:
        """A relay asks for its place in the tree of relays (or a head says where it
        listens); without a tree, every relay stays on its link to the kernel."""
        if self._tree is not None:
            self._tree.take(link, message)
        elif isinstance(message, JoinTree):
            link.send(TreePlace())

    def _end(self, peer: _Peer) -> None:
        """The connection is over: each rank that spoke through it (and, for a relay,
        was still connected to it) is disconnected."""
        if self._tree is not None and peer.link is not None:
            self._tree.ended(peer.link)
        self._forget(peer.sock, peer.spoke)
        for rank, route in sorted(peer.spoke.items()):
            self._deliver(Disconnected(rank, route.attempt, route.requeue,
                                       relay_lost=route.relayed))

    def _take(self, message: Any, link: _Link, spoke: dict[int, _Route],
              relayed: bool) -> None:
        """Note who sent ``message`` (a rank's first message names it: messages to that
        rank go back the way it came), then deliver it."""
        rank = getattr(message, "rank", None)
        if isinstance(message, Disconnected):  # (a relay's word: that rank's link closed)
            route = spoke.pop(message.rank, None)
            with self._lock:
                if route is not None and self._peers.get(message.rank) is route:
                    del self._peers[message.rank]
                    self._fan_out = None
        elif rank is not None and rank not in spoke:
            spoke[rank] = _Route(link, relayed, getattr(message, "attempt", 0),
                                 getattr(message, "requeue", 0))
            with self._lock:
                self._peers[rank] = spoke[rank]
                self._fan_out = None
        self._deliver(message)

    def _forget(self, sock: socket.socket, spoke: dict[int, _Route]) -> None:
        """The connection is over: its ranks are reached no more (unless they connected
        again since)."""
        with self._lock:
            self._connections.discard(sock)
            for rank, route in spoke.items():
                if self._peers.get(rank) is route:
                    del self._peers[rank]
                    self._fan_out = None
        sock.close()

    def send(self, rank: int, message: Any, data: Outgoing | None = None) -> bool:
        """Send ``message`` to ``rank`` (with ``data``: the data file it names); False if
        that rank is not connected (any more)."""
        if data is None:
            return self.send_encoded(rank, encode(message))
        with self._lock:
            route = self._peers.get(rank)
        if route is None:
            return False
        try:
            route.link.send(ForRank(rank, message) if route.relayed else message, data)
        except OSError:
            return False
        return True

    def send_encoded(self, rank: int, frame: bytes) -> bool:
        """Send ``rank`` the message ``encode``d in ``frame``; False if it is not connected
        (a node's relay hands one frame to each of its ranks this way)."""
        with self._lock:
            route = self._peers.get(rank)
        return route is not None and self._send_on(
            route.link, encode(ToRanks((rank,), frame)) if route.relayed else frame)

    def quiet(self, ranks: Iterable[int], since: float) -> set[int]:
        """Those of ``ranks`` whose link (their own, or their node relay's) brought no
        message since ``since`` (``time.monotonic()``), or that are not connected."""
        fan_out = self._fan_out_to(ranks)
        quiet = set(fan_out.missed)
        for link, on_link in fan_out.links:
            if link.heard < since:
                quiet.update(on_link)
        return quiet

    def send_to_each(self, ranks: Iterable[int], message: Any) -> set[int]:
        """Send ``message`` to each of ``ranks``, encoded once: to a rank's own connection,
        and once to a node's relay for all of its ranks. The ranks it could not reach."""
        return self.send_frame_to_each(ranks, encode(message))

    def send_frame_to_each(self, ranks: Iterable[int], frame: bytes) -> set[int]:
        """``send_to_each`` for a message already ``encode``d (a relay hands on the
        kernel's frame to the ranks, or relays, behind it)."""
        fan_out = self._fan_out_to(ranks)
        missed = set(fan_out.missed)
        for link, on_link in fan_out.links:
            if not self._send_on(link, encode(ToRanks(on_link, frame)) if link in
                                 fan_out.relays else frame):
                missed.update(on_link)
        return missed

    def _fan_out_to(self, ranks: Iterable[int]) -> _FanOut:
        """How ``ranks`` are reached, link by link; the last one is kept until a route
        changes (a session's every cell goes to the same ranks: with a tree of relays,
        thousands of ranks over a few dozen links)."""
        wanted = ranks if isinstance(ranks, tuple) else tuple(ranks)
        with self._lock:
            if self._fan_out is None or self._fan_out[0] != wanted:
                self._fan_out = (wanted, _FanOut([(rank, self._peers.get(rank))
                                                  for rank in wanted]))
            return self._fan_out[1]

    @staticmethod
    def _send_on(link: _Link, frame: bytes) -> bool:
        try:
            link.send_encoded(frame)
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
        self._reads.close()
        if isinstance(self.address, Path):
            self.address.unlink(missing_ok=True)


# --- rank side ------------------------------------------------------------------------


class ChannelClient:
    """A rank's authenticated connection to the kernel; ``send`` is thread-safe, and
    one thread at a time may ``receive``. Data files the kernel sends land in ``inbox``."""

    def __init__(self, address: Address, key: bytes, inbox: Inbox | None = None) -> None:
        sock, where = _new_socket(address)
        try:
            sock.settimeout(_HANDSHAKE_TIMEOUT)
            sock.connect(where)
            self._link = _answer_kernel(sock, key)
            self._link.inbox = inbox
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise

    def send(self, message: Any, data: Outgoing | None = None) -> None:
        self._link.send(message, data)

    def receive(self, timeout: float | None = None) -> Any:
        """The kernel's next message; ConnectionError once the kernel has closed the link
        (or a frame on the way was forged, or none came within ``timeout`` seconds: the
        link is then of no more use). A ``timeout`` is for a link no other thread uses
        yet (it holds for the socket's sends too)."""
        try:
            if timeout is None:
                return self._link.receive()
            self._link.sock.settimeout(timeout)
            try:
                return self._link.receive()
            finally:
                self._link.sock.settimeout(None)
        except OSError as exc:
            raise ConnectionError(f"the kernel's link broke: {exc}") from exc

    @property
    def local_host(self) -> str:
        """The address this end of a TCP link has: where the kernel's machine (and so the
        cluster's other machines) reach this one."""
        if self._link.sock.family not in (socket.AF_INET, socket.AF_INET6):
            raise OSError("a link on this machine (a Unix socket) has no network address")
        return str(self._link.sock.getsockname()[0])

    def close(self) -> None:
        """Hang up (a thread waiting in ``receive`` gets ConnectionError)."""
        with contextlib.suppress(OSError):
            self._link.sock.shutdown(socket.SHUT_RDWR)
        self._link.sock.close()
