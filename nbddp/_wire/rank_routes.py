"""How the kernel's end of the channel reaches each rank: by the rank's own connection,
or by its node relay's.

A connection (``Peer``) is known by the ranks that spoke through it; each rank's way back
is a ``Route``; a message for many ranks goes once per link that reaches some of them
(``FanOut``). Both the server (``_wire.channel``) and its read loop
(``_wire.read_loop``) hold these.
"""

from __future__ import annotations

import dataclasses
import socket

from .sealed_link import SealedLink


@dataclasses.dataclass(frozen=True)
class Route:
    """How the kernel reaches a rank: its own connection, or its node's relay's; and
    which attempt it was (for the ``Disconnected`` its connection's end makes)."""

    link: SealedLink
    relayed: bool = False
    attempt: int = 0
    requeue: int = 0



class FanOut:
    """How a set of ranks is reached: per link, the ranks it reaches (in order), which of
    those links are relays' (a frame to them names its ranks: ``ToRanks``), and the
    ranks not connected."""

    def __init__(self, routes: list[tuple[int, Route | None]]) -> None:
        by_link: dict[SealedLink, list[int]] = {}
        self.relays: set[SealedLink] = set()
        self.missed: set[int] = set()
        for rank, route in routes:
            if route is None:
                self.missed.add(rank)
                continue
            by_link.setdefault(route.link, []).append(rank)
            if route.relayed:
                self.relays.add(route.link)
        self.links = [(link, tuple(sorted(on_link))) for link, on_link in by_link.items()]


class Peer:
    """A connection's state in the kernel: its link once the handshake is done, and the
    ranks that spoke through it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.link: SealedLink | None = None
        self.spoke: dict[int, Route] = {}
