"""What a node's relay (``_rank.relay``) and the kernel say to each other about the node's
ranks, and how the relays of many nodes form a tree (``_wire.relay_tree``).

    kernel -> relay  ToRanks (one frame for some of its ranks), ForRank (a message that
                     came with a data file)
    relay -> kernel  FromRanks (its ranks' messages, batched), FromRank (one with a data
                     file), with RanksPresent, RanksFinished and NodeMetrics for what many
                     of them said alike
    the tree         JoinTree, HeadListens (up) and TreePlace (down)

Past many nodes the same passes between a group's head and its group's relays (a head
merges its group's batches). A relay wraps the ranks' own messages (``_wire.messages``);
the kernel's end of the channel unwraps them (``_wire.channel``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .rank_stats import StatsColumns


@dataclass(frozen=True)
class ToRanks:
    """To a node's relay: hand the message in ``frame`` (``encode``d once for every node
    it goes to) to each of ``ranks`` on the node. The kernel sends a run's Start once per
    node this way."""

    ranks: tuple[int, ...]
    frame: bytes


@dataclass(frozen=True)
class ForRank:
    """To a node's relay: hand ``message`` to ``rank``. It came with a data file, which
    landed on the node (``message.file`` says where): the node's copy of a payload, for
    the rank to keep."""

    rank: int
    message: Any


@dataclass(frozen=True)
class FromRank:
    """From a node's relay: one rank's message that came with a data file, sent on with
    its file (``message.file``, set where it landed on the kernel's machine)."""

    message: Any


@dataclass(frozen=True)
class FromRanks:
    """From a node's relay (or a group's head, for its group): what the node's ranks sent
    since its last batch, each rank's in the order it sent them (``Disconnected`` where a
    rank's connection to the relay closed), what many ranks said alike said once
    (``RanksPresent``, ``RanksFinished``). One frame, one check and one wake-up of the
    kernel for the whole node."""

    messages: list[Any]


@dataclass(frozen=True)
class RanksPresent:
    """From a node's relay: each of ``ranks`` answered roll call ``call`` (``Present``)."""

    ranks: tuple[int, ...]
    call: int


@dataclass(frozen=True)
class RanksFinished:
    """From a node's relay (or a group's head, merged for its group): each of ``ranks``
    finished its run with nothing to send back
    (no value, no names): their ``Result``s, at once, and their stats (of those that
    sent some)."""

    ranks: tuple[int, ...]
    stats: StatsColumns
    attempt: int = 0
    requeue: int = 0


@dataclass(frozen=True)
class NodeMetrics:
    """From a node's relay (or a group's head, merged for its group): its ranks' ``Metrics``
    since its last batch, reduced. Per step,
    the ranks heard and per metric the sum and count of their values (a rank's last value
    of a step and metric, if it sent several); each rank's latest progress position; and
    the records that speak for every rank, as each rank sent them."""

    partials: list[tuple[int, tuple[int, ...], dict[str, tuple[float, int]]]]
    positions: dict[int, tuple[int, int | None, str | None]]
    for_all: list[tuple[int, list[tuple[int, dict[str, float]]]]]
    attempt: int = 0
    requeue: int = 0


# --- a tree of relays (many nodes: ``_wire.relay_tree``) -------------------------------


@dataclass(frozen=True)
class JoinTree:
    """From a node's relay, its first word where the kernel arranges the relays as a tree:
    where is its place? The kernel answers ``TreePlace``."""


@dataclass(frozen=True)
class TreePlace:
    """To a relay that asked (``JoinTree``). ``listen``: it heads a group, stays on the
    kernel's link, and listens for the group's other relays (and says where:
    ``HeadListens``); ``parent``: it speaks to the kernel through that relay, its group's
    head; neither: it stays on the kernel's link alone."""

    listen: bool = False
    parent: tuple[str, int] | None = None


@dataclass(frozen=True)
class HeadListens:
    """From a group's head relay: the relays of its group connect to ``address`` (None:
    it cannot listen; they stay on the kernel's link)."""

    address: tuple[str, int] | None
