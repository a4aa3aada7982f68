"""A node's relay started: on a link of its own to the kernel, or placed in the tree.

``node_relay`` is how a node's torchrun (``_rank.torchrun``) starts the relay
(``_rank.relay``) of its ranks. With many nodes the kernel arranges the relays as a tree
(``_wire.relay_tree``): a relay first asks the kernel for its place, then speaks to its
group's head instead of the kernel, or heads a group and listens for its group's
relays beside its ranks (``HeadDown``). Making those links is here; the relay itself
only carries messages over them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._wire.channel import Address, ChannelClient, ChannelServer
from .._wire.relay_messages import HeadListens, JoinTree, TreePlace
from .._wire.transfer import Inbox
from .relay import Landing, NodeRelay, Reattach
from .relay_down import HeadDown, Ranks

_PLACE_WAIT = 30.0  # seconds a relay waits to learn its place in a tree (its head's word)


def node_relay(kernel: Address, listen: Path, key: bytes, inbox: Inbox | None = None,
               landing: Landing | None = None, reattach: Reattach | None = None,
               tree: bool = False) -> NodeRelay:
    """The relay of this node's ranks, which connect to ``listen`` with ``key``, to the
    kernel at ``kernel``. On a cluster's node (the kernel elsewhere) data files cross it
    both ways: a payload from the kernel lands in ``inbox`` for a rank to keep, and a
    rank's result lands in ``landing`` on its way to the kernel. ``reattach``: how it
    reaches the next kernel, when one attaches (``NodeRelay``). ``tree``: the kernel
    arranges the nodes' relays as a tree (``placed_relay``)."""
    files = landing.inbox if landing else None
    return placed_relay(lambda: ChannelClient(kernel, key, inbox), key,
                        lambda deliver: ChannelServer(listen, key, deliver, files),
                        inbox=inbox, landing=landing, reattach=reattach, tree=tree)


def placed_relay(connect: Callable[[], ChannelClient], key: bytes,
                 ranks: Callable[[Callable[[Any], None]], Ranks], *,
                 inbox: Inbox | None = None, landing: Landing | None = None,
                 reattach: Reattach | None = None, tree: bool = False) -> NodeRelay:
    """The relay of the ranks ``ranks(deliver)`` makes, on a link to the kernel that
    ``connect`` makes (as ``node_relay``'s). ``tree``: it first asks the kernel for its
    place in the tree of relays (``_wire.relay_tree``): it may speak through its group's
    head instead, or head a group, whose relays then connect to it as well as its
    ranks."""
    up, heads = _place_in_tree(connect, key, inbox) if tree else (connect(), False)
    files = landing.inbox if landing else None
    group: ChannelServer | None = None  # (a head's: where its group's relays connect)
    heading = heads  # (a next kernel's relays join it each on a link of its own)

    def ranks_and_relays(deliver: Callable[[Any], None]) -> Ranks:
        nonlocal group, heading
        here = ranks(deliver)
        if not heading:
            return here
        heading = False
        try:
            group = ChannelServer((up.local_host, 0), key, deliver, files)
        except OSError as exc:
            print(f"nbddp: this node's relay cannot listen for its group's relays ({exc}); "
                  "they speak to the kernel themselves", file=sys.stderr)
            return here
        return HeadDown(here, group)

    relay = NodeRelay(up, ranks_and_relays, landing, reattach)
    if heads:
        with contextlib.suppress(OSError):  # (the kernel went: the relay's end says so)
            up.send(HeadListens((up.local_host, group.port or 0) if group else None))
    return relay


def _place_in_tree(connect: Callable[[], ChannelClient], key: bytes, inbox: Inbox | None
                   ) -> tuple[ChannelClient, bool]:
    """Ask the kernel (on a link ``connect`` makes) for this relay's place in the tree of
    relays: the link it speaks on (the kernel's, or its group's head's), and whether it
    heads a group. A relay that cannot reach its head, or is told nothing in
    ``_PLACE_WAIT`` seconds (its head asked, and hangs), stays on a kernel link of its
    own."""
    up = connect()
    try:
        up.send(JoinTree())
        place = up.receive(timeout=_PLACE_WAIT)
    except ConnectionError as exc:
        up.close()
        print(f"nbddp: this node's relay was given no place among the relays ({exc}); it "
              "speaks to the kernel itself", file=sys.stderr)
        return connect(), False
    if not isinstance(place, TreePlace):
        up.close()
        raise ConnectionError(f"the kernel sent a {type(place).__name__} where this "
                              "node's relay asked for its place")
    if place.parent is None:
        return up, place.listen
    try:
        head = ChannelClient(place.parent, key, inbox)
    except OSError as exc:
        print(f"nbddp: this node's relay cannot reach its group's head at "
              f"{place.parent[0]}:{place.parent[1]} ({exc}); it speaks to the kernel itself",
              file=sys.stderr)
        return up, False
    up.close()
    return head, False
