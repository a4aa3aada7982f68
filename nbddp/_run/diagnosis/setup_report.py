"""Why ranks hang in process-group set-up: what the ranks' looks (``_rank.setup_check``)
say together.

A rank waiting in ``init_process_group`` waits for peers it will never meet: two ranks
that joined as the same rank, a world size torchrun did not start, an address changed,
or processes of a library's that set up a group of their own on torchrun's agent
store. Each rank sees its own part; the kernel lines them up here, and where it finds
no cause it says what it looked at.
"""

from __future__ import annotations

from collections import defaultdict

from ..._wire.hang_messages import AGENT_STORE_ENV, Collectives, SetupLook

HEADER = "process-group set-up (init_process_group):"
_COMMAND_WIDTH = 70


def setup_report(answers: dict[int, Collectives]) -> str:
    """The set-up part of a hang report, or "" where no rank is in
    ``init_process_group`` and none changed anything that set-up depends on."""
    looks = {rank: a.setup for rank, a in sorted(answers.items()) if a.setup is not None}
    if not looks:
        return ""
    lines = [HEADER]
    for rank, look in looks.items():
        lines += _world_lines(rank, look) + _address_lines(rank, look)
        lines += _children_lines(rank, look)
    lines += _same_rank_lines(looks)
    inside = sorted(rank for rank, look in looks.items() if look.in_init)
    if len(lines) == 1 and inside:
        lines += _nothing_found(inside, sorted(set(answers) - set(inside)))
    return "\n".join(lines) if len(lines) > 1 else ""


def _world_lines(rank: int, look: SetupLook) -> list[str]:
    if not look.in_init:
        return []
    lines = []
    if look.rank is not None and look.torchrun_rank is not None and \
            look.rank != look.torchrun_rank:
        lines.append(f"rank {rank} called init_process_group(rank={look.rank}); torchrun "
                     f"made it rank {look.torchrun_rank}")
    if look.world_size is not None and look.torchrun_world_size is not None and \
            look.world_size != look.torchrun_world_size:
        lines.append(f"rank {rank} called init_process_group with world_size="
                     f"{look.world_size}; torchrun started {look.torchrun_world_size} ranks")
    if look.init_method is not None:
        lines.append(f"rank {rank} called init_process_group with init_method="
                     f"{look.init_method!r}, but torchrun tells every rank to use its agent "
                     f"store ({AGENT_STORE_ENV}=True): no rank hosts a store there")
    return lines


def _address_lines(rank: int, look: SetupLook) -> list[str]:
    why = (f"under torchrun ({AGENT_STORE_ENV}=True) every rank looks for torchrun's store "
           "there, and none hosts one" if look.agent_store
           else "every rank must meet at the same address")
    return [f"rank {rank} changed {name} from {old} (torchrun's) to {new}: {why}"
            for name, old, new in look.changed]


def _children_lines(rank: int, look: SetupLook) -> list[str]:
    if not look.agent_store_children:
        return []
    shown = "; ".join(f"pid {pid}: {_short(command)}"
                      for pid, command in look.agent_store_children[:3])
    more = len(look.agent_store_children) - 3
    shown += f"; and {more} more" if more > 0 else ""
    return [f"rank {rank} started processes that inherited torchrun's {AGENT_STORE_ENV}=True "
            f"({shown}): if they set up a process group, it waits for torchrun's agent "
            "store, which none of them hosts. Remove it before they start, in the cell: "
            f"os.environ.pop({AGENT_STORE_ENV!r}, None)"]


def _same_rank_lines(looks: dict[int, SetupLook]) -> list[str]:
    """Two or more ranks inside ``init_process_group`` as the same rank."""
    joined: dict[int, list[int]] = defaultdict(list)
    for rank, look in looks.items():
        if look.in_init and look.rank is not None:
            joined[look.rank].append(rank)
    return [f"{_together(ranks)} joined as rank {same}: each rank must pass its own rank "
            "(int(os.environ['RANK'])), or none, and torch reads torchrun's"
            for same, ranks in sorted(joined.items()) if len(ranks) > 1]


def _together(ranks: list[int]) -> str:
    """``ranks 0 and 1 both`` or ``ranks 0, 1, 2 all``."""
    if len(ranks) == 2:
        return f"ranks {ranks[0]} and {ranks[1]} both"
    return f"ranks {', '.join(map(str, ranks))} all"


def _nothing_found(inside: list[int], outside: list[int]) -> list[str]:
    lines = [f"{_who(inside)} in init_process_group with the rank and world size torchrun "
             "gave, MASTER_ADDR and MASTER_PORT unchanged, and no process of theirs set to "
             "use torchrun's agent store: nbddp found no cause there"]
    if outside:
        lines.append(f"{_who(outside)} not in init_process_group: the ranks inside wait "
                     "there until every rank has called it")
    return lines


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]} is" if len(ranks) == 1 else \
        f"ranks {', '.join(map(str, ranks))} are"


def _short(command: str) -> str:
    return command if len(command) <= _COMMAND_WIDTH else command[:_COMMAND_WIDTH - 3] + "..."
