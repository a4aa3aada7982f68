"""What a running rank says about itself about once a second, and how many ranks' of it
travel together.

``RankStats``: where it runs, its last step, its memory, how much output it wrote (for
stall detection); ``StatsColumns``: many ranks' of them as a few tuples (a node's, or a
group's, as their run ended); ``StepTimes``: where its steps' time went. These are most of
what the kernel hears from thousands of ranks, so their shape is chosen for that: named
tuples and columns, which unpickle faster than an object per rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple


class RankStats(NamedTuple):
    """A running rank about once a second: where it runs, its last step (logged, or its
    progress), its memory, and how much output it has written (for stall detection).
    (A named tuple: each rank's comes back with every cell's end, a node's in one batch,
    and unpickles in half the time of a dataclass.)"""

    rank: int
    host: str
    pid: int
    step: int | None
    rss_mb: float | None
    gpu_mem_mb: float | None
    output_bytes: int


class StatsColumns(NamedTuple):
    """Many ranks' ``RankStats``, a tuple per field: a node's (or a group's) as their run
    ended. It crosses and unpickles as a few tuples, not an object per rank (thousands,
    each cell, which the kernel's garbage collector would go through); ``rows()`` makes
    the ranks' own where they are looked at."""

    rank: tuple[int, ...]
    host: tuple[str, ...]
    pid: tuple[int, ...]
    step: tuple[int | None, ...]
    rss_mb: tuple[float | None, ...]
    gpu_mem_mb: tuple[float | None, ...]
    output_bytes: tuple[int, ...]

    @classmethod
    def of(cls, stats: Iterable[RankStats | None]) -> StatsColumns:
        """The columns of ``stats`` (those that are None left out). A node's ranks' host
        is one string, pickled once."""
        rows = [each for each in stats if each is not None]
        if not rows:
            return cls((), (), (), (), (), (), ())
        columns = cls(*zip(*rows, strict=True))
        hosts: dict[str, str] = {}
        return columns._replace(host=tuple(hosts.setdefault(host, host)
                                           for host in columns.host))

    @classmethod
    def joined(cls, parts: list[StatsColumns]) -> StatsColumns:
        """``parts`` as one, in their order."""
        if len(parts) == 1:
            return parts[0]
        return cls(*(tuple(chain.from_iterable(column))
                     for column in zip(*parts, strict=True))) if parts else cls.of(())

    def rows(self) -> Iterator[RankStats]:
        return map(RankStats._make, zip(*self, strict=True))


@dataclass(frozen=True)
class StepTimes:
    """A running rank about once a second, once it has steps: where their time went
    since the run began (``_rank.step_clock``: these only grow)."""

    rank: int
    steps: int
    data_s: float
    """Waiting for the next batch."""
    step_s: float
    """In the steps."""
    comm_s: float
    """Of the steps' time, waiting in DDP's gradient all-reduce (sampled steps only)."""
    comm_samples: int
    """How many steps ``comm_s`` was measured over (0: no DDP model measured it)."""
