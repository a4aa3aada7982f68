"""A tree of relays: from a few dozen nodes, the kernel speaks to one relay per group.

With a relay per node (``_rank.relay``) the kernel's work per cell grows with the nodes:
per node, a Start sealed and sent, and a batch of reports read, checked, decoded and
taken in. From ``TREE_FROM`` nodes on that is most of the kernel's work. The relays then
form groups of about the square root of the nodes: the first relay of a group to reach
the kernel heads it, and the group's other relays connect to their head instead of the
kernel. To the kernel a head is a relay whose ranks are its group's; to the relays of its
group it is the kernel. What the group's ranks say reaches the kernel in the head's
batches, merged as a node's relay merges its ranks' (``_rank.relay_compact``: finished
ranks, roll-call answers, metrics reduced to a sum and count per step and name), and the
kernel sends a cell's Start once per group. At 1,024 nodes the kernel has 32 links, not
1,024 (``benchmarks/bench_nodes.py``).

No rendezvous of its own: the kernel's channel is the directory. Each relay's first word
is ``JoinTree``; the kernel places it (``RelayTree``) as it asks, in that order: a head,
which listens for its group (on the address its link to the kernel leaves from, which the
cluster's machines reach) and says where (``HeadListens``), or a member, told its head's
address once the head has said it. Every link is the channel's (the run's key, every
frame sealed and checked), a relay's link to its head too.

A head that dies is its group lost: the kernel sees every rank of the group disconnected,
as a relay's death is a node's. A head dies with its node's torchrun, whose ranks' death
breaks every collective of the group anyway. A relay that cannot reach its head (or whose
head went before it said where it listens) stays on the kernel's link: slower, not lost.
A cluster session's relays that wait for the next kernel (``reattach``) join it each on a
link of its own.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from typing import Any, Protocol

from .relay_messages import HeadListens, JoinTree, TreePlace

TREE_FROM = 64
"""A session of this many nodes or more has its relays form a tree (measured with
``benchmarks/bench_nodes.py``: see ``benchmarks/README.md``)."""
TREE_FROM_ENV = "NBDDP_RELAY_TREE_FROM"
"""Overrides ``TREE_FROM`` (the tests form a tree of two nodes)."""


def uses_tree(nodes: int) -> bool:
    """Whether a session of ``nodes`` nodes (each with a relay) forms a tree of relays."""
    return nodes >= int(os.environ.get(TREE_FROM_ENV) or TREE_FROM)


def group_size(nodes: int) -> int:
    """The relays in a group (its head among them): about the square root of the nodes,
    so that neither the kernel nor a head speaks to many more links than the other."""
    return max(2, math.isqrt(nodes - 1) + 1)


class Link(Protocol):
    def send(self, message: Any) -> None: ...


class RelayTree:
    """The kernel's side: places each relay of ``nodes`` as it asks (see the module)."""

    def __init__(self, nodes: int) -> None:
        self._size = group_size(nodes)
        self._lock = threading.Lock()
        self._joined = 0
        self._heads: dict[Link, int] = {}  # a head's link -> its group
        self._addresses: dict[int, tuple[str, int] | None] = {}  # group -> (None: gone)
        self._waiting: dict[int, list[Link]] = {}  # group -> members told nothing yet

    def take(self, link: Link, message: Any) -> bool:
        """True if ``message`` (from ``link``) is the tree's business, and taken."""
        if isinstance(message, JoinTree):
            self._join(link)
        elif isinstance(message, HeadListens):
            self._settle(link, message.address, gone=False)
        else:
            return False
        return True

    def _join(self, link: Link) -> None:
        with self._lock:
            group, first = divmod(self._joined, self._size)
            self._joined += 1
            if first == 0:
                self._heads[link] = group
                answer: TreePlace | None = TreePlace(listen=True)
            elif group in self._addresses:
                answer = TreePlace(parent=self._addresses[group])
            else:
                self._waiting.setdefault(group, []).append(link)
                answer = None
        if answer is not None:
            _tell(link, answer)

    def ended(self, link: Link) -> None:
        """``link`` closed: if it was a head, its group's relays that ask from now on (or
        still wait: it had not said where it listens) stay on the kernel's link."""
        self._settle(link, None, gone=True)

    def _settle(self, link: Link, address: tuple[str, int] | None, gone: bool) -> None:
        """Where the group of the head on ``link`` connects from now on: at ``address``
        (None: to the kernel, each on its link), as its head says once, or as it goes;
        the group's relays that wait are told."""
        with self._lock:
            group = self._heads.pop(link, None) if gone else self._heads.get(link)
            if group is None or (not gone and group in self._addresses):
                return  # (a stranger's word, or said twice)
            parent = (str(address[0]), int(address[1])) if address else None
            self._addresses[group] = parent
            waiting = self._waiting.pop(group, [])
        for member in waiting:
            _tell(member, TreePlace(parent=parent))


def _tell(link: Link, place: TreePlace) -> None:
    with contextlib.suppress(OSError):  # (that relay has gone: its link's end says so)
        link.send(place)
