"""Which of a session's ranks a run is given to: ``Session.run(fn, ranks=[0])``,
``%%ddp --ranks 0,3`` or ``--ranks 1:`` (Python's slice, over the session's ranks).

The ranks not chosen stay at rest with their state; the run's value is the lowest chosen
rank's. A collective in such a run waits for the resting ranks forever: the user's to
avoid (the hang report says so).
"""

from __future__ import annotations

from collections.abc import Iterable


def chosen_ranks(ranks: Iterable[int] | None, nprocs: int) -> tuple[int, ...] | None:
    """``ranks`` checked against a session of ``nprocs`` ranks, sorted; None: every rank
    (as is a choice of every rank)."""
    if ranks is None:
        return None
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise TypeError(f"ranks must be a list of rank numbers, got {ranks!r}")
    chosen = list(ranks)
    bad = [r for r in chosen if isinstance(r, bool) or not isinstance(r, int)]
    if bad:
        raise TypeError(f"ranks must be rank numbers (ints), got {bad!r}")
    outside = sorted({r for r in chosen if not 0 <= r < nprocs})
    if outside:
        raise ValueError(f"the session has ranks 0 to {nprocs - 1}; there is no rank "
                         f"{', '.join(map(str, outside))}")
    if not chosen:
        raise ValueError("ranks is empty: name at least one rank")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"ranks names a rank twice: {chosen}")
    picked = tuple(sorted(chosen))
    return None if picked == tuple(range(nprocs)) else picked


def parse_ranks(text: str, nprocs: int) -> tuple[int, ...] | None:
    """``"0"``, ``"0,3"``, ``"1:"``, ``":2"``, ``"0:4:2"``: the ranks named, each part a
    rank or a slice of ``range(nprocs)``; checked by ``chosen_ranks``."""
    named: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if ":" in part:
                bounds = [int(b) if b.strip() else None for b in part.split(":")]
                if len(bounds) > 3:
                    raise ValueError(part)
                named += range(nprocs)[slice(*bounds)]
            else:
                named.append(int(part))
        except ValueError:
            raise ValueError(f"--ranks takes rank numbers and slices such as 0, 0,3 or 1:, "
                             f"got {text!r}") from None
    return chosen_ranks(sorted(set(named)), nprocs)  # (a rank named twice is named)
