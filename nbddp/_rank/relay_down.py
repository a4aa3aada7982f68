"""A node's relay's side towards the ranks it speaks for, and a group head's.

The relay (``_rank.relay``) hands the kernel's messages down to whatever ``Ranks`` it
was given: its node's ranks' links (``ChannelServer``), or a simulation of ranks in a
benchmark. A group's head in the tree of relays (``_wire.relay_tree``) hands them down
to its own ranks and to its group's relays alike (``HeadDown``): to the relay above, it
is one more set of ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from .._wire.channel import ChannelServer
from .._wire.frames import encode
from .._wire.relay_messages import ForRank
from .._wire.transfer import Outgoing


class Ranks(Protocol):
    """The relay's side towards its node's ranks: where it hands them the kernel's
    messages (``ChannelServer``, ``HeadDown`` for a group's head, or a simulation of
    ranks: ``benchmarks/bench_nodes.py``)."""

    def send_encoded(self, rank: int, frame: bytes) -> bool: ...

    def send_frame_to_each(self, ranks: Iterable[int], frame: bytes) -> set[int]: ...

    def close(self) -> None: ...


class HeadDown:
    """A group's head relay's side towards its node's ranks and its group's relays
    (``_wire.relay_tree``): a message for ranks goes to those on this node, and once to
    each relay for the ranks behind it. A message with a data file for a rank behind
    another relay goes on to it with its file."""

    def __init__(self, ranks: Ranks, relays: ChannelServer) -> None:
        self.ranks, self.relays = ranks, relays

    def send_encoded(self, rank: int, frame: bytes) -> bool:
        return self.ranks.send_encoded(rank, frame) or self.relays.send_encoded(rank, frame)

    def send_frame_to_each(self, ranks: Iterable[int], frame: bytes) -> set[int]:
        missed = self.ranks.send_frame_to_each(ranks, frame)
        return self.relays.send_frame_to_each(missed, frame) if missed else missed

    def hand_on(self, message: ForRank) -> None:
        """``message`` came with a data file, which landed on this node: to its rank here,
        or on to the relay its rank is behind (the file goes with it, and leaves here).
        Where this node had no room for it (no ``file``), the rank is told so, as it
        would be on its own node."""
        if self.ranks.send_encoded(message.rank, encode(message.message)):
            return
        if not message.message.file:
            self.relays.send_encoded(message.rank, encode(message.message))
            return
        file = Path(message.message.file)
        try:
            self.relays.send(message.rank, message.message, Outgoing.of_file(file))
        finally:
            file.unlink(missing_ok=True)

    def close(self) -> None:
        self.relays.close()
        self.ranks.close()
