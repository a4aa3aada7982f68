"""The authenticated channel between the ranks and the kernel, in both directions: the
kernel's end (``ChannelServer``) and a rank's (``ChannelClient``).

The kernel listens on a Unix socket inside the run's private (0700) directory, or, for
ranks on other machines (a SLURM job), on a TCP port of the address the ranks are told
to use. Either way the only secret is the run's random key (a 0600 file), and a peer
must prove it holds the key before anything it sends is unpickled (``_wire.handshake``);
then every frame is sealed and numbered (``_wire.sealed_link``). The kernel reaches a rank
by the connection it spoke on, its own or its node relay's (``_wire.rank_routes``), and
reads most connections with one thread (``_wire.read_loop``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .frames import encode
from .handshake import HANDSHAKE_TIMEOUT, answer_kernel, challenge_rank
from .messages import Disconnected
from .rank_routes import FanOut, Peer, Route
from .read_loop import ReadLoop
from .relay_messages import ForRank, FromRank, FromRanks, HeadListens, JoinTree, ToRanks, TreePlace
from .relay_tree import RelayTree
from .sealed_link import SealedLink
from .transfer import Inbox, Outgoing

logger = logging.getLogger(__name__)

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


class ChannelServer:
    """Accepts authenticated rank connections, hands each message to ``deliver``, and
    sends messages to a rank once it has spoken (its first message names its rank).

    ``address`` is a socket path, or a TCP (host, port) to bind (port 0: any free one;
    ``port`` says which). Each connection's handshake has a thread of its own, so one
    that says nothing holds up no other (and is dropped after the handshake timeout);
    then one thread reads them all (``ReadLoop``), or, where ranks may send data files,
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
        self._peers: dict[int, Route] = {}
        self._fan_out: tuple[tuple[int, ...], FanOut] | None = None
        """(Under the lock) The last fan-out asked for, until a route changes."""
        self._lock = threading.Lock()
        self._closed = False
        self._reads = ReadLoop(self._handle, self._end)
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
        peer = Peer(sock)
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            peer.link = challenge_rank(sock, self._key)
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

    def _handle(self, peer: Peer, message: Any) -> None:
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

    def _place(self, link: SealedLink, message: JoinTree | HeadListens) -> None:
        """A relay asks for its place in the tree of relays (or a head says where it
        listens); without a tree, every relay stays on its link to the kernel."""
        if self._tree is not None:
            self._tree.take(link, message)
        elif isinstance(message, JoinTree):
            link.send(TreePlace())

    def _end(self, peer: Peer) -> None:
        """The connection is over: each rank that spoke through it (and, for a relay,
        was still connected to it) is disconnected."""
        if self._tree is not None and peer.link is not None:
            self._tree.ended(peer.link)
        self._forget(peer.sock, peer.spoke)
        for rank, route in sorted(peer.spoke.items()):
            self._deliver(Disconnected(rank, route.attempt, route.requeue,
                                       relay_lost=route.relayed))

    def _take(self, message: Any, link: SealedLink, spoke: dict[int, Route],
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
            spoke[rank] = Route(link, relayed, getattr(message, "attempt", 0),
                                 getattr(message, "requeue", 0))
            with self._lock:
                self._peers[rank] = spoke[rank]
                self._fan_out = None
        self._deliver(message)

    def _forget(self, sock: socket.socket, spoke: dict[int, Route]) -> None:
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

    def _fan_out_to(self, ranks: Iterable[int]) -> FanOut:
        """How ``ranks`` are reached, link by link; the last one is kept until a route
        changes (a session's every cell goes to the same ranks: with a tree of relays,
        thousands of ranks over a few dozen links)."""
        wanted = ranks if isinstance(ranks, tuple) else tuple(ranks)
        with self._lock:
            if self._fan_out is None or self._fan_out[0] != wanted:
                self._fan_out = (wanted, FanOut([(rank, self._peers.get(rank))
                                                  for rank in wanted]))
            return self._fan_out[1]

    @staticmethod
    def _send_on(link: SealedLink, frame: bytes) -> bool:
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
            sock.settimeout(HANDSHAKE_TIMEOUT)
            sock.connect(where)
            self._link = answer_kernel(sock, key)
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
