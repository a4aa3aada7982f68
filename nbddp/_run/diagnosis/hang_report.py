"""What the ranks were doing together: each rank's place in its collectives, and who a
waiting collective waits for.

A hung DDP job is nearly always one rank not entering a collective the others wait in:
rank 0 waits in ``all_reduce`` #12 while rank 1 completed #11 and is elsewhere (a helper,
a data loader, an ``if rank == 0`` branch). Stacks say where each rank is; this says why
the others cannot go on. Each rank reads torch's flight recorder (``_rank/collectives``);
the kernel lines the answers up, per process group.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from ..._wire.hang_messages import Collectives, GroupProgress
from .setup_report import setup_report

if TYPE_CHECKING:
    from ..groups.group import RankGroup

HEADER = "collectives (torch's flight recorder; #N counts each process group's collectives):"


def look_at(group: RankGroup, ranks: set[int], starting: Collection[int] = ()
            ) -> tuple[dict[int, str], str]:
    """``ranks``' stacks (``stack_view``), then the hang report (asked after the stacks
    came: a rank dumping its stacks while it starts a thread to answer the other
    question may dump before its main thread's turn)."""
    if not group.can_ask:
        return {}, ""
    stacks = {rank: text for rank, text in group.stacks().items() if rank in ranks}
    return stacks, ask_for_report(group, ranks, starting)


def ask_for_report(group: RankGroup, ranks: set[int], starting: Collection[int] = ()) -> str:
    """Ask the group's ranks where they are in their collectives; the report for ``ranks``
    (``starting``: those of them that have not said hello yet)."""
    answers = group.collectives()
    return hang_report({r: a for r, a in answers.items() if r in ranks}, ranks,
                       starting=starting)


def hang_report(answers: dict[int, Collectives], ranks: Iterable[int],
                now: float | None = None, starting: Collection[int] = ()) -> str:
    """The report for ``ranks``, from the ``answers`` that came (a rank without one did
    not answer; one of ``starting`` had not said hello yet: it was still starting, not
    stuck)."""
    now = time.time() if now is None else now
    asked = sorted(set(ranks))
    lines = [HEADER]
    names = sorted({g.group for a in answers.values() for g in a.groups}, key=_group_order)
    for name in names:
        progress = {rank: g for rank, a in answers.items() for g in a.groups if g.group == name}
        lines += _group_lines(progress, None if len(names) == 1 else _label(progress), now)
    for rank in asked:
        answer = answers.get(rank)
        if answer is None and rank in starting:
            lines.append(f"rank {rank}: still starting (it had not said hello to the "
                         "kernel yet)")
        elif answer is None:
            lines.append(f"rank {rank}: did not answer (its link to the kernel is gone, or "
                         "its Python is held by native code)")
        elif answer.unavailable:
            lines.append(f"rank {rank}: no record of its collectives ({answer.unavailable})")
    counted = sorted(rank for rank, answer in answers.items() if answer.counted)
    if counted:
        why = answers[counted[0]].counted
        lines.append(f"{_ranks(counted)}: counted by the process groups, as {why}; the "
                     "collective a rank waits in is read from its stack")
    if not names and len(lines) == 1:
        lines.append("no rank has a process group")
    setup = setup_report(answers)  # (why a rank waits in init_process_group: first)
    if setup and all(getattr(answers.get(rank), "unavailable", "") == "no process group"
                     for rank in asked):
        return setup  # (no rank has a process group yet: no collectives to tell of)
    return "\n".join([setup, *lines] if setup else lines)


def _group_lines(progress: dict[int, GroupProgress], label: str | None,
                 now: float) -> list[str]:
    lines = [f"process group {label}:"] if label else []
    indent = "  " if label else ""
    for rank, g in sorted(progress.items()):
        lines.append(f"{indent}rank {rank}: {_place(g, now)}")
    lines += [indent + line for line in _who_is_missing(progress)]
    return lines


def _place(g: GroupProgress, now: float) -> str:
    if g.entered > g.completed:
        op = g.waiting_op or "a collective"
        since = f" (for {max(0, int(now - g.waiting_since))} s)" if g.waiting_since else ""
        return f"waits in {op} #{g.completed + 1}{since}"
    if g.completed == 0:
        return "has entered no collective yet"
    op = f" ({g.completed_op})" if g.completed_op else ""
    return f"has completed #{g.completed}{op} and is not in a collective"


def _who_is_missing(progress: dict[int, GroupProgress]) -> list[str]:
    """Per collective some rank waits in: which ranks have not entered it, and whether
    the ranks that did disagree on what it is (a desync)."""
    lines = []
    waiting = sorted({g.completed + 1 for g in progress.values() if g.entered > g.completed})
    for number in waiting:
        inside = {r: g for r, g in progress.items() if g.entered >= number}
        missing = sorted(set(progress) - set(inside))
        ops = {g.waiting_op for g in inside.values() if g.completed + 1 == number and g.waiting_op}
        if len(ops) > 1:
            said = ", ".join(f"rank {r} {g.waiting_op}" for r, g in sorted(inside.items())
                             if g.completed + 1 == number)
            lines.append(f"the ranks disagree on collective #{number}: {said}")
        if missing:
            op = next(iter(ops)) if len(ops) == 1 else "collective"
            who = _ranks(missing)
            lines.append(f"{op} #{number} waits for {who}, which {_has(missing)} not entered it")
    return lines


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _has(ranks: list[int]) -> str:
    return "has" if len(ranks) == 1 else "have"


def _label(progress: dict[int, GroupProgress]) -> str:
    g = next(iter(progress.values()))
    return f"{g.label} ({len(progress)} ranks)"


def _group_order(name: str) -> tuple[int, int, str]:
    """The default group first, then by number, then by name."""
    return (0, 0, "") if name == "0" else (1, int(name), "") if name.isdigit() else (2, 0, name)
