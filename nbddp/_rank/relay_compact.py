"""A relay's batch as it goes to the kernel: what many ranks said alike, said once.

A node's relay (``_rank.relay``) sends what its ranks said in batches. Much of it is
alike from rank to rank: the answers to a roll call, a plain end of a run, metrics. One
message for the batch's ranks (``RanksPresent``, ``RanksFinished``, ``NodeMetrics``)
costs the kernel one decode instead of one per rank. Which messages merge, and how,
is this module's alone; when a batch waits for more is the relay's.
"""

from __future__ import annotations

from typing import Any

from .._wire.messages import Metrics, Present, Result, Sequenced
from .._wire.rank_stats import StatsColumns
from .._wire.relay_messages import NodeMetrics, RanksFinished, RanksPresent
from .node_metrics import merged, reduced


def compact(batch: list[Any]) -> list[Any]:
    """``batch`` (a ``None`` in it: the end) as it goes to the kernel: what many ranks
    said alike said once (the roll call's answers, plain results, metrics reduced: see
    ``_said_once``), every rank's messages still in the order it sent them. A group goes
    before a later message of one of its ranks, else at the batch's end. What a group's
    head relays for the relays of its group (already said once per node) is merged the
    same way (``_wire.relay_tree``)."""
    out: list[Any] = []
    groups: dict[tuple, tuple[set[int], list[Any]]] = {}
    for message in batch:
        key, ranks = _group_of(message), _ranks_of(message)
        for other in [k for k, (members, _) in groups.items()
                      if k != key and not members.isdisjoint(ranks)]:
            out.append(_said_once(other, groups.pop(other)[1]))  # (its rank speaks again)
        if key is not None:
            members, said = groups.setdefault(key, (set(), []))
            members.update(ranks)
            said.append(message)
        elif message is not None:
            out.append(message)
    out.extend(_said_once(key, said) for key, (_, said) in groups.items())
    return out


def merges(message: Any) -> bool:
    """``message`` is one that a batch says once for many ranks (``compact``)."""
    return _group_of(message) is not None


def is_metrics(message: Any) -> bool:
    """A rank's metrics, or (to a group's head) a node's."""
    return isinstance(message, NodeMetrics) or (
        isinstance(message, Sequenced) and isinstance(message.message, Metrics))


def _group_of(message: Any) -> tuple | None:
    """Which group ``message`` joins, if many ranks say it alike."""
    if isinstance(message, Sequenced):
        inner = message.message
        if isinstance(inner, Present):
            return ("present", inner.call)
        if isinstance(inner, Result) and inner.value is None and inner.file is None \
                and inner.assigned is None \
                and inner.restored is None:  # (what a rank says of its own goes as its own)
            return ("finished", message.attempt, message.requeue)
        if isinstance(inner, Metrics):
            return ("metrics", message.attempt, message.requeue)
        return None
    if isinstance(message, RanksPresent):
        return ("present", message.call)
    if isinstance(message, (RanksFinished, NodeMetrics)):
        kind = "finished" if isinstance(message, RanksFinished) else "metrics"
        return (kind, message.attempt, message.requeue)
    return None


def _ranks_of(message: Any) -> tuple[int, ...]:
    """The ranks ``message`` speaks for (none: the end, or a relay's own word)."""
    if isinstance(message, (RanksPresent, RanksFinished)):
        return message.ranks
    if isinstance(message, NodeMetrics):
        heard = [rank for _, ranks, _ in message.partials for rank in ranks]
        return (*heard, *message.positions, *(rank for rank, _ in message.for_all))
    rank = getattr(message, "rank", None)  # (a Sequenced's is its message's)
    return (rank,) if rank is not None else ()


def _said_once(key: tuple, said: list[Any]) -> Any:
    if key[0] == "present":
        return RanksPresent(tuple(rank for message in said for rank in _present(message)),
                            key[1])
    if key[0] == "finished":
        groups = [message for message in said if isinstance(message, RanksFinished)]
        results = [message.message for message in said if isinstance(message, Sequenced)]
        ranks = [rank for group in groups for rank in group.ranks]
        ranks += [result.rank for result in results]
        stats = [group.stats for group in groups]
        if results:
            stats.append(StatsColumns.of(result.stats for result in results))
        return RanksFinished(tuple(ranks), StatsColumns.joined(stats), attempt=key[1],
                             requeue=key[2])
    nodes = [message for message in said if isinstance(message, NodeMetrics)]
    ranks_own = [message.message for message in said if isinstance(message, Sequenced)]
    if ranks_own:
        nodes.append(reduced(ranks_own))
    return merged(nodes, attempt=key[1], requeue=key[2])


def _present(message: Any) -> tuple[int, ...]:
    return message.ranks if isinstance(message, RanksPresent) else (message.message.rank,)

