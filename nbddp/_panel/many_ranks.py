"""How the panel speaks of many ranks: counts per state and the few ranks worth a look.

A chip per rank reads well for a handful of ranks. Past ``MANY_RANKS`` the panel says how
many ranks are in each state, and names the ranks a user looks for: those that failed,
those that fall behind, the slowest and the fastest. Every rank is shown on demand (the
widget panel's toggle); until then the kernel works out the notes of those few alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

MANY_RANKS = 16
"""More ranks than this: counts and notable ranks, every rank on demand."""
SHOWN_PER_KIND = 3
"""Failed ranks and ranks that fall behind named, at most, each (the rest counted)."""
_STATE_ORDER = ("failed", "debugging", "requeueing", "running", "starting", "stopped",
                "finished", "resting")


def counts(states: Sequence[str]) -> str:
    """``1020 running, 3 failed, 1 stopped``: how many ranks are in each state."""
    tally = Counter(states)
    ordered = sorted(tally, key=lambda s: _STATE_ORDER.index(s) if s in _STATE_ORDER
                     else len(_STATE_ORDER))
    return ", ".join(f"{tally[state]} {state}" for state in ordered)


def notable(states: Sequence[str], reported: Iterable[int], behind: set[int],
            rates: Mapping[int, float | None]) -> list[tuple[str, int]]:
    """The ranks worth naming, each with why: the first few that failed (of those that
    ``reported`` a failure: thousands of states are not looked at one by one ten times a
    second) and that fall behind, then the slowest and the fastest of those that report
    a speed."""
    named: list[tuple[str, int]] = []
    failed = sorted(rank for rank in set(reported) if states[rank] == "failed")
    named += [("failed", rank) for rank in failed[:SHOWN_PER_KIND]]
    named += [("behind", rank) for rank in sorted(behind)[:SHOWN_PER_KIND]]
    speeds = {rank: rate for rank, rate in rates.items() if rate is not None}
    if len(speeds) >= 2:
        named.append(("slowest", min(speeds, key=lambda r: (speeds[r], r))))
        named.append(("fastest", max(speeds, key=lambda r: (speeds[r], -r))))
    first = {rank: why for why, rank in reversed(named)}  # a rank named once, first why
    return [(why, rank) for why, rank in named if first[rank] == why]
