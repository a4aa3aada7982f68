"""A node's ranks' metrics as one message: per step and metric, a sum and a count.

Each rank sends its metrics about ten times a second. A node's relay that sent each
batch on would have the kernel read, check and average every rank's; it sends the
node's instead (``NodeMetrics``): per step and metric name, the sum and count of its
ranks' values, which the kernel adds up into the mean over all ranks. A group's head
(``_wire.relay_tree``) merges its group's nodes' the same way. Pure functions over
messages, apart from the relay's threads, so that the arithmetic is tested alone.
"""

from __future__ import annotations

from .._wire.messages import Metrics
from .._wire.relay_messages import NodeMetrics


def reduced(batches: list[Metrics], attempt: int = 0, requeue: int = 0) -> NodeMetrics:
    """The node's ranks' metric batches as one: per step and metric, the sum and count of
    the ranks' values (each rank's last value, should it have sent one twice)."""
    values: dict[int, dict[str, dict[int, float]]] = {}  # step -> name -> rank -> value
    heard: dict[int, dict[int, None]] = {}  # step -> the ranks with a record of it
    positions, for_all = {}, []
    for batch in batches:
        for step, metrics in batch.records:
            heard.setdefault(step, {})[batch.rank] = None
            by_name = values.setdefault(step, {})
            for name, value in metrics.items():
                by_name.setdefault(name, {})[batch.rank] = value
        if batch.position is not None:
            positions[batch.rank] = batch.position
        if batch.for_all:
            for_all.append((batch.rank, batch.for_all))
    partials = [(step, tuple(heard[step]),
                 {name: (sum(by_rank.values()), len(by_rank)) for name, by_rank in by_name.items()})
                for step, by_name in values.items()]
    return NodeMetrics(partials, positions, for_all, attempt, requeue)


def merged(nodes: list[NodeMetrics], attempt: int = 0, requeue: int = 0) -> NodeMetrics:
    """Nodes' reduced metrics as one (a group's head merges its group's): per step, the
    sums and counts added, where the nodes' ranks are apart (a node's two batches that
    both hold a step keep a partial each, as they would reach the kernel unmerged)."""
    if len(nodes) == 1:
        only = nodes[0]
        return NodeMetrics(only.partials, only.positions, only.for_all, attempt, requeue)
    steps: dict[int, list[tuple[dict[int, None], dict[str, list[float]]]]] = {}
    positions: dict[int, tuple[int, int | None, str | None]] = {}
    for_all: list[tuple[int, list[tuple[int, dict[str, float]]]]] = []
    for node in nodes:
        for step, ranks, sums in node.partials:
            _add_partial(steps.setdefault(step, []), ranks, sums)
        positions.update(node.positions)
        for_all.extend(node.for_all)
    partials = [(step, tuple(ranks), {name: (total, int(count))
                                      for name, (total, count) in sums.items()})
                for step, parts in steps.items() for ranks, sums in parts]
    return NodeMetrics(partials, positions, for_all, attempt, requeue)


def _add_partial(parts: list[tuple[dict[int, None], dict[str, list[float]]]],
                 ranks: tuple[int, ...], sums: dict[str, tuple[float, int]]) -> None:
    """One node's partial of a step into the step's ``parts``: into the first whose ranks
    (in the order heard) it does not share, else a part of its own."""
    part = next((part for part in parts if part[0].keys().isdisjoint(ranks)), None)
    if part is None:
        part = ({}, {})
        parts.append(part)
    heard, totals = part
    heard.update(dict.fromkeys(ranks))
    for name, (total, count) in sums.items():
        into = totals.setdefault(name, [0.0, 0])
        into[0] += total
        into[1] += count
