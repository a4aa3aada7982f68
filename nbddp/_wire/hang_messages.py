"""What the kernel asks a rank that may be stuck, and what the rank answers.

    kernel -> rank   ShowStacks, ShowCollectives
    rank -> kernel   Stacks (every thread's stack), Collectives (its progress in each
                     process group, ``GroupProgress``, and what it can tell about its
                     process-group set-up, ``SetupLook``)

A run that seems hung is looked at through these (``_run.diagnosis.hang_report``). They are apart
from the run's own conversation (``_wire.messages``), which never needs them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShowStacks:
    """Send back every thread's stack (``Stacks``): how the kernel asks a rank on
    another machine, which it cannot signal."""

    call: int
    """Which request: an answer to an earlier one does not count."""


@dataclass(frozen=True)
class Stacks:
    """A rank's answer to ``ShowStacks``: faulthandler's dump of its threads (None if it
    did not come), and which thread is the rank's main one."""

    rank: int
    call: int
    dump: str | None
    main: str | None


@dataclass(frozen=True)
class ShowCollectives:
    """Send back where this rank is in its collectives (``Collectives``)."""

    call: int
    """Which request: an answer to an earlier one does not count."""


@dataclass(frozen=True)
class GroupProgress:
    """Where a rank is in one process group's collectives, as torch's flight recorder
    counts them (sequence numbers from 1, per process group)."""

    group: str
    """The process group's name (``"0"`` is the default group)."""
    label: str
    """Its description (``default_pg``, or what ``new_group(group_desc=...)`` said)."""
    completed: int
    """The last collective this rank completed (0: none yet)."""
    entered: int
    """The last collective this rank entered (enqueued)."""
    completed_op: str = ""
    """The last completed one's operation (``all_reduce``), if the recorder still has it."""
    waiting_op: str = ""
    """The first one entered and not completed, if any."""
    waiting_since: float | None = None
    """When the rank entered that one (seconds since the epoch)."""


AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""torchrun's word to its ranks: set up process groups on its own store, as clients."""


@dataclass(frozen=True)
class SetupLook:
    """What a rank can tell about its process-group set-up (``_rank.setup_check``)."""

    in_init: bool
    """Its main thread is inside ``init_process_group``."""
    rank: int | None = None
    """The ``rank`` that call was given (None: left to the environment)."""
    world_size: int | None = None
    init_method: str | None = None
    """The ``init_method`` it was given, where it was given one beside torchrun's agent
    store (no rank hosts a store at that address)."""
    torchrun_rank: int | None = None
    """The rank and world size torchrun gave it."""
    torchrun_world_size: int | None = None
    changed: tuple[tuple[str, str | None, str | None], ...] = ()
    """``(name, torchrun's value, the value now)`` for MASTER_ADDR/PORT it changed."""
    agent_store_children: tuple[tuple[int, str], ...] = ()
    """``(pid, command)`` of processes it started that would use torchrun's agent store."""
    agent_store: bool = False
    """torchrun told it to use its agent store (``TORCHELASTIC_USE_AGENT_STORE=True``)."""


@dataclass(frozen=True)
class Collectives:
    """A rank's answer to ``ShowCollectives``: its progress in each process group, or
    why it cannot say (``unavailable``: no process group, no flight recorder), and what
    it can tell about its process-group set-up (``setup``)."""

    rank: int
    call: int
    groups: tuple[GroupProgress, ...] = ()
    unavailable: str = ""
    counted: str = ""
    """Why ``groups`` are the process groups' own counts, not the recorder's (its entries'
    operations and times then unknown; the one it waits in read from its stack)."""
    setup: SetupLook | None = None
