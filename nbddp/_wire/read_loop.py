"""The kernel's one thread that reads every rank connection that brings no data file.

The channel's server (``_wire.channel``) hands each connection to the ``ReadLoop`` once
its handshake is done, and hears of its messages and its end through two callbacks. A
selector loop, its wake-ups and its end are one thing to read, apart from the server.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import selectors
import socket
import threading
from collections.abc import Callable
from typing import Any

from .rank_routes import Peer

logger = logging.getLogger(__name__)


class ReadLoop:
    """One thread reading every connection that brings no data file: whichever has whole
    frames, their messages go to ``handle``; a connection that closes, or whose frame
    fails its check, to ``end``. (A thread per connection costs the kernel a wake-up and
    a turn of the interpreter lock per message: with a connection per node of a large
    cluster, most of its time.)

    Nothing escapes the loop: a callback that raises ends its own connection and no
    other, so one bad message cannot leave every rank unheard."""

    def __init__(self, handle: Callable[[Peer, Any], None],
                 end: Callable[[Peer], None]) -> None:
        self._handle, self._end = handle, end
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake = socket.socketpair()
        self._wake_read.setblocking(False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._added: queue.SimpleQueue[Peer] = queue.SimpleQueue()
        self._adding = threading.Lock()  # (an add and the loop's end: one or the other)
        self._closed = self._stopped = False
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="nbddp-channel-reads")
        self._thread.start()

    def add(self, peer: Peer) -> None:
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

    def _read(self, peer: Peer) -> None:
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

    def _finish(self, peer: Peer, why: str) -> None:
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
