"""A node's relay: the one connection between the kernel and a node's ranks.

Without it the kernel serves every rank: one connection, one Start and one report per
rank per cell, each sealed and checked, each a wake-up of its own. With it the kernel
sends a cell's Start once per node (``ToRanks``), and what the node's ranks send comes
back in batches (``FromRanks``): one frame, one check and one wake-up for whatever the
node's ranks said meanwhile. The relay is threads in the node's torchrun process
(``_rank.torchrun``), which waits on its ranks anyway: it costs no rank any time.

To its ranks the relay is the kernel: they connect to its socket, in the run's private
dir, with the run's key, as they would to the kernel's. To the kernel it is a rank whose
messages name many ranks. When the kernel's link closes, the relay closes its ranks'
links (a busy rank then stops, as it would were it connected to the kernel itself);
when the relay dies, its torchrun process died, and the ranks die with it (each rank
dies with its parent): the kernel sees every rank of the node disconnected.

A cluster session's ranks outlive their kernel, for a new one to attach (``attachable``).
Its relay does too (``reattach``): once its ranks' links are closed it waits for the
next kernel, connects to it, and only then listens for its ranks again; they connect
through it, greet the new kernel as they greeted the last, and the node keeps its one
connection. What a rank said to the kernel that went, read late, goes to none.

Here the relay carries messages and times its batches. How it starts, and its place in a
tree of relays: ``relay_placement``; its side towards its ranks (and a group head's
towards its group's relays): ``relay_down``; what a batch says once for many ranks:
``relay_compact``, with the metrics' sums and counts in ``node_metrics``.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .._wire.channel import ChannelClient
from .._wire.frames import encode
from .._wire.messages import Sequenced
from .._wire.relay_messages import (
    ForRank,
    FromRank,
    FromRanks,
    ToRanks,
)
from .._wire.transfer import Outgoing, place_in
from .relay_compact import compact, is_metrics, merges
from .relay_down import HeadDown, Ranks

_BATCH_MOST = 1024  # messages in one batch: a frame stays small whatever the ranks say
_METRICS_WAIT = 0.05  # seconds a batch of metrics alone waits for the node's other ranks'
_GROUP_GAP = 0.002  # seconds a head's batch waits for the next of its group's reports
_GROUP_WAIT = 0.02  # ... and in all, at most


Reattach = Callable[[Callable[[], bool]], ChannelClient | None]
"""How a relay reaches the next kernel that attaches: it waits for one, and connects to it
(None: none came, or the relay closed meanwhile, which the function it is given says)."""


class NodeRelay:
    """Speaks to the kernel over ``up`` for the ranks that ``ranks(deliver)`` makes,
    which hands it what they say."""

    def __init__(self, up: ChannelClient, ranks: Callable[[Callable[[Any], None]], Ranks],
                 landing: Landing | None = None, reattach: Reattach | None = None) -> None:
        """``reattach``, if given: once the kernel's link closes, wait for the next
        kernel and connect to it (``Reattach``)."""
        self._up, self._landing, self._ranks, self._reattach = up, landing, ranks, reattach
        self._outbox: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._kernel = 0  # which kernel the ranks' links speak to: one more each attach
        try:
            self._down = ranks(self._said_to(0))
        except BaseException:
            up.close()
            raise
        self._closing = threading.Lock()  # (and ``_kernel``, ``_up`` and ``_down`` change)
        self._closed = False
        self._sender = threading.Thread(target=self._send_up, daemon=True,
                                        name="nbddp-relay-up")
        self._sender.start()
        threading.Thread(target=self._hand_down, daemon=True, name="nbddp-relay-down").start()

    def _said_to(self, kernel: int) -> Callable[[Any], None]:
        """How the ranks' links of ``kernel`` (the relay's count) hand on what they say."""
        return lambda message: self._outbox.put((kernel, message))

    def _send_up(self) -> None:
        """Send what the ranks said, batched (``_gather``), to the kernel they said it to.
        Once closed, what was said before goes too, then the kernel's link closes. What
        was said to a kernel that went goes to no other (its data files are removed),
        and the relay goes on if it waits for the next."""
        while True:
            said = self._gather()
            with self._closing:
                kernel, up = self._kernel, self._up
            batch = [message for to, message in said if to == kernel or message is None]
            self._drop(message for to, message in said if to != kernel and message is not None)
            ends = said[-1][1] is None
            try:
                self._send_batch(compact(batch), up)
            except OSError:
                self._drop(batch)
                ends = ends or self._reattach is None or self._closed
            if ends:
                break
        self.close()
        self._up.close()

    def _send_batch(self, said: list[Any], up: ChannelClient) -> None:
        """``said`` in one frame, but for a message that came with a data file: it goes
        on alone with its file (``FromRank``), in its place among the others."""
        plain: list[Any] = []
        for message in said:
            file = self._file_of(message)
            if not file:
                plain.append(message)
                continue
            if plain:
                up.send(FromRanks(plain))
                plain = []
            try:
                up.send(FromRank(message), Outgoing.of_file(Path(file)))
            finally:
                Path(file).unlink(missing_ok=True)  # (the kernel has its own copy now)
        if plain:  # (the end alone says nothing)
            up.send(FromRanks(plain))

    def _drop(self, messages: Iterable[Any]) -> None:
        """Messages that go to no kernel: the data files they came with are removed."""
        for message in messages:
            file = self._file_of(message)
            if file:
                Path(file).unlink(missing_ok=True)

    def _file_of(self, message: Any) -> str:
        """The data file a rank's message came with, if any (landed in ``_landing``)."""
        inner = message.message if isinstance(message, Sequenced) else message
        file = getattr(inner, "file", None) or ""
        return file if self._landing is not None and self._landing.holds(file) else ""

    def _gather(self) -> list[tuple[int, Any]]:
        """The next batch, each message with the kernel it was said to: whatever waits
        once a message came. Metrics alone wait up to ``_METRICS_WAIT`` more for the
        node's other ranks' (each rank sends its own about ten times a second): they
        are reduced together. What a head merges (its group's ends of a run, answers to
        a roll call) waits a moment after each report (``_GROUP_GAP``): its group's
        relays report one after another."""
        batch = [self._outbox.get()]
        began = time.monotonic()
        heads = isinstance(self._down, HeadDown)  # (as the batch begins)
        only_metrics = is_metrics(batch[0][1])
        merged = merges(batch[0][1])
        while True:
            if batch[-1][1] is None or len(batch) >= _BATCH_MOST:
                break
            try:
                batch.append(self._outbox.get_nowait())
            except queue.Empty:
                wait = _more_wait(began, only_metrics, merged, heads)
                if wait <= 0:
                    break
                try:
                    batch.append(self._outbox.get(timeout=wait))
                except queue.Empty:
                    break
            only_metrics = only_metrics and is_metrics(batch[-1][1])
            merged = merged and merges(batch[-1][1])
        return batch

    def _hand_down(self) -> None:
        """Hand each of the kernel's messages to the ranks it is for, until the kernel's
        link closes; then close the ranks' links (and, with ``reattach``, serve the next
        kernel: again and again)."""
        while True:
            self._serve(self._up)
            if self._reattach is None or not self._next_kernel():
                break
        self.close()

    def _serve(self, up: ChannelClient) -> None:
        try:
            while True:
                self._hand_on(up.receive())
        except (ConnectionError, EOFError):
            pass

    def _hand_on(self, message: Any) -> None:
        """One of the kernel's messages to the ranks (or relays) it is for. One that
        cannot be handed on is said and dropped: the kernel's next ones still go (a
        relay that stopped reading would leave its ranks, and the kernel, waiting)."""
        try:
            if isinstance(message, ToRanks):
                self._down.send_frame_to_each(message.ranks, message.frame)
            elif isinstance(message, ForRank):  # (its data file is on this node)
                if isinstance(self._down, HeadDown):
                    self._down.hand_on(message)
                else:
                    self._down.send_encoded(message.rank, encode(message.message))
        except Exception as exc:  # noqa: BLE001 - said, and the relay goes on
            print(f"nbddp: this node's relay could not hand on a {type(message).__name__} "
                  f"({exc})", file=sys.stderr)

    def _next_kernel(self) -> bool:
        """The kernel went: close the ranks' links (they stop their run and wait for a
        kernel), connect to the next kernel, then listen for the ranks again. False if
        the relay closed meanwhile, or no kernel came, or the ranks' socket cannot be
        made again."""
        assert self._reattach is not None
        with self._closing:
            if self._closed:
                return False
            self._kernel += 1  # (what the old links still hand on goes nowhere)
            gone = self._down
        gone.close()
        self._up.close()
        up = self._reattach(lambda: self._closed)
        if up is None:
            return False
        with self._closing:
            if self._closed:
                up.close()
                return False
            try:
                self._down = self._ranks(self._said_to(self._kernel))
            except OSError as exc:
                print(f"nbddp: this node's relay cannot listen for its ranks again ({exc});"
                      " they reach no kernel", file=sys.stderr)
                up.close()
                return False
            self._up = up
        return True

    def close(self, wait: float = 0.0) -> None:
        """Close the ranks' links; what they said goes to the kernel, then its link
        closes (``wait``: up to that many seconds, for the torchrun that ends)."""
        with self._closing:
            if not self._closed:
                self._closed = True
                self._down.close()
                self._outbox.put((self._kernel, None))
        if wait and threading.current_thread() is not self._sender:
            self._sender.join(wait)


class Landing:
    """Where the data files a relay's ranks send (results, on a cluster's node whose
    kernel is elsewhere) land on their way to the kernel: folders of the relay's own, in
    shared memory where a file fits, else on disk. What lands there is sent on, then
    removed; a message's ``file`` elsewhere (a node's copy of a payload, named to the
    kernel) is only a name."""

    def __init__(self, shm: Path | None, disk: Path) -> None:
        self.folders = [folder for folder in (shm, disk) if folder is not None]
        for folder in self.folders:
            folder.mkdir(mode=0o700, exist_ok=True)
        self.inbox = place_in(shm, disk)

    def holds(self, file: str) -> bool:
        return bool(file) and Path(file).parent in self.folders


def _more_wait(began: float, only_metrics: bool, merged: bool, heads: bool) -> float:
    """How much longer a batch begun at ``began`` waits for the next message."""
    now = time.monotonic()
    if only_metrics:
        return began + _METRICS_WAIT - now
    if not merged:
        return 0.0
    return min(_GROUP_GAP, began + _GROUP_WAIT - now) if heads else 0.0
