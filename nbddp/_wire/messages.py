"""What the kernel and the ranks tell each other in a run.

Every message is a small frozen dataclass, framed one way (``_wire.frames``) for the
channel's sockets and the start file (a mailbox file marks and checksums each message
instead: ``_wire.mailbox``). Messages are only decoded from authenticated peers or from
private (0600) files.
Tensor and array bytes do not travel in messages: they are in data files (``_wire.dataplane``)
that a message names; to and from another machine, the file goes along with the message
(``_wire.transfer``).

    rank -> kernel   Hello, Ready, Present, Metrics, StopRequested, DebugPrompt, DebugDone,
                     Assigned, PayloadKept, OutputBytes, and a report:
                     Result, Failure or Requeueing (each Sequenced)
    kernel -> rank   RollCall, KeepPayload, Start, DebugInput, Interrupt
    kernel only      Disconnected (a rank's connection closed)

Beside these, each in a module of its own: what a running rank says about itself about
once a second (``_wire.rank_stats``), what the kernel asks a rank that may be stuck and
its answers (``_wire.hang_messages``), and what a node's relay wraps its ranks' messages
in (``_wire.relay_messages``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .rank_stats import RankStats
from .relay_messages import RanksFinished
from .snapshot_orders import RestoreNote, RestoreOrder, SnapshotNote, SnapshotOrder


@dataclass(frozen=True)
class RankOptions:
    """How a rank runs the user's function."""

    init: bool = True
    """Initialise (and destroy) the default process group around the function."""
    backend: str | None = None
    """The process group's backend; None: NCCL on a GPU rank, gloo otherwise."""
    all_ranks: bool = False
    """Every rank sends its return value back, not only rank 0."""
    post_mortem: bool = False
    """A rank that raises opens pdb at the failing frame (the notebook answers) first."""
    ranks: tuple[int, ...] | None = None
    """The ranks that run the code (a session's cell on some ranks); the others stay at
    rest and keep their state. None: every rank."""
    autoreload: bool = False
    """A session's rank reloads the user's modules whose files changed, before the code."""
    snapshot: SnapshotOrder | None = None
    """A session's rank keeps its names once the run ended well (``_rank.snapshot``)."""
    restore: RestoreOrder | None = None
    """Fresh ranks of a session load their snapshot first."""

    def runs_on(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    @property
    def answering(self) -> int:
        """The rank whose value is the run's (and whose names the session keeps)."""
        return min(self.ranks) if self.ranks else 0


# --- rank -> kernel -------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """A rank is up and connected."""

    rank: int
    pid: int
    node: str = ""
    """The machine it runs on (SLURM's name for it, or the host's)."""
    local_rank: int = 0
    """Its place among that machine's ranks: local rank 0 keeps the machine's data files."""
    versions: tuple[tuple[str, str], ...] = ()
    """A rank on another machine: its Python, torch, cloudpickle and nbddp versions,
    which the kernel compares with its own (``_wire.versions``)."""


@dataclass(frozen=True)
class Ready:
    """A rank has imported torch (and joined its gloo group, if asked) and waits for Start."""

    rank: int


@dataclass(frozen=True)
class Present:
    """A rank's answer to a ``RollCall``: it is alive and reads the kernel's messages."""

    rank: int
    call: int


@dataclass(frozen=True)
class Assigned:
    """A session's rank 0: the names its session code has bound, which the notebook
    therefore no longer sends. Said to a kernel that attaches, and after a run that ended
    in neither a ``Result`` nor a ``Failure`` (which carry the names themselves)."""

    rank: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class PayloadKept:
    """A node's local rank 0 has the payload the kernel sent (``KeepPayload``) in
    ``file``, on its node, for the node's ranks to map; ``""``: the node had no room."""

    rank: int
    file: str


@dataclass(frozen=True)
class OutputBytes:
    """What a rank wrote to its output since its last ``OutputBytes``, from a node that
    shares no filesystem with the kernel (a Ray node): the kernel appends it to the
    rank's log in the run's records, where the notebook reads it as any rank's log."""

    rank: int
    data: bytes


@dataclass(frozen=True)
class Result:
    """A rank finished; its return value when the kernel wants it: pickled in ``value``,
    or, with tensor or array bytes, in the data file ``file``; ``stats``: the rank's as
    the run ended (a run's first stats come a tenth of a second in: a quick run has no
    other)."""

    rank: int
    value: bytes | None = None
    file: str | None = None
    stats: RankStats | None = None
    assigned: tuple[str, ...] | None = None
    """A session's answering rank: the names its code has bound (as ``Assigned``)."""
    restored: RestoreNote | None = None
    """What the rank loaded from its snapshot before the run (``_rank.snapshot``)."""


@dataclass(frozen=True)
class SnapshotTaken:
    """(At rest, after a session's cell) The rank's snapshot of the cell is written, or
    could not be: what it could not keep (``_rank.snapshot``)."""

    rank: int
    note: SnapshotNote


@dataclass(frozen=True)
class Failure:
    """A rank raised. ``exception`` is the pickled exception when it could be pickled."""

    rank: int
    type_name: str
    module: str
    message: str
    traceback: str
    exception: bytes | None = None
    time: float = field(default_factory=time.time)
    stats: RankStats | None = None
    """The rank's stats as it failed (as a ``Result``'s)."""
    assigned: tuple[str, ...] | None = None
    """A session's answering rank: the names its code has bound (as a ``Result``'s)."""
    restored: RestoreNote | None = None
    """What the rank loaded from its snapshot before the run failed."""

@dataclass(frozen=True)
class DebugPrompt:
    """A rank's pdb wants a line: what it printed since its last one, ending in its prompt."""

    rank: int
    text: str


@dataclass(frozen=True)
class DebugDone:
    """A rank's pdb let the code go on (``c`` or ``q``): the next rank may be served."""

    rank: int


@dataclass(frozen=True)
class Requeueing:
    """A rank of a SLURM job ended its attempt with ``nbddp.requeue()``: once every rank
    has ended, the job goes back to the queue and runs again."""

    rank: int


@dataclass(frozen=True)
class StopRequested:
    """SLURM told the job its time limit is near (``Slurm(signal_before=...)``); the
    rank's ``nbddp.stop_requested()`` is now true."""

    rank: int


@dataclass(frozen=True)
class Metrics:
    """A batch of one rank's ``nbddp.log`` records and its ``nbddp.progress`` position."""

    rank: int
    records: list[tuple[int, dict[str, float]]]
    position: tuple[int, int | None, str | None] | None = None
    for_all: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    """Records that speak for every rank (already reduced, or logged on the main
    process only, as Accelerate's ``log`` is): averaged at once, not waited for."""


@dataclass(frozen=True)
class Sequenced:
    """A rank's message and its place in that rank's stream. A rank may send each
    message on two links (socket and mailbox file); the kernel keeps the first copy."""

    seq: int
    message: Any
    attempt: int = 0
    """Which of torchrun's attempts sent it (``TORCHELASTIC_RESTART_COUNT``): after a
    restart, what the failed attempt still sends is stale."""
    requeue: int = 0
    """How many times SLURM had requeued the job when it was sent (``SLURM_RESTART_COUNT``);
    each requeue starts torchrun's attempts again from 0."""

    @property
    def rank(self) -> int:
        return self.message.rank


# --- kernel -> rank -------------------------------------------------------------------


@dataclass(frozen=True)
class RollCall:
    """Sent to ranks that wait for their ``Start`` (standby, a session at rest) just
    before it: each answers ``Present`` at once, so a run is never handed to a group
    that lost a process while idle (that group is stopped, and fresh ranks take it)."""

    call: int
    """Which roll call: an answer to an earlier one does not count."""


@dataclass(frozen=True)
class Start:
    """Run this: the payload file, where the run's records go, and what changed in the
    notebook since the rank started (working directory, environment)."""

    version: str
    """The kernel's nbddp version; a rank with another one refuses to run."""
    records: str
    """The run's records folder: the rank moves its log there."""
    payload: str
    """The payload's data file (private: in the run dir, or its twin in shared memory)."""
    options: RankOptions
    cwd: str | None = None
    """The notebook's working directory, if the rank started in another."""
    env: dict[str, str | None] = field(default_factory=dict)
    """Environment changes since the rank started (None: unset)."""
    session: bool = False
    """Keep the namespace and the process group, and wait for the next Start after this."""
    data: str | None = None
    """The run dir's twin in shared memory, where a result's data file goes if it fits."""
    packed: bytes | None = None
    """The payload itself, when it is small and has no data file (``payload`` is then
    unused)."""
    remote: bool = False
    """A result's data file crosses the channel (the kernel runs on another machine, and
    its payload came that way too)."""


@dataclass(frozen=True)
class KeepPayload:
    """To a node's local rank 0: keep the run's payload on the node for its ranks, and say
    where (``PayloadKept``). It came as a data file with this message (``file``: where it
    landed on the node), or is to be copied from the session's folder (``copy_from``).
    The node's ``Start`` follows once it has it."""

    file: str = ""
    copy_from: str = ""


@dataclass(frozen=True)
class Interrupt:
    """Raise ``KeyboardInterrupt`` in the user's code, as SIGINT would: how the kernel
    interrupts a session's rank (a signal could overtake the run's Start, and a rank on
    another machine cannot be signalled)."""


@dataclass(frozen=True)
class DebugInput:
    """The notebook's answer to a ``DebugPrompt``: the user's line for pdb, or None and
    why nobody can answer (the rank then goes on)."""

    line: str | None
    reason: str = ""


# --- kernel-side events ---------------------------------------------------------------


@dataclass(frozen=True)
class Disconnected:
    """A rank's connection closed."""

    rank: int
    attempt: int = 0
    requeue: int = 0
    relay_lost: bool = False
    """It closed because the link to the rank's node relay did: the whole node is lost."""


def run_ended_for(message: Any) -> tuple[int, ...]:
    """The ranks whose part in the run ``message`` says is over: a rank's ``Result``,
    ``Failure`` or requeue (numbered or not), a node's ``RanksFinished``, or a link's end
    (its rank will say nothing more). What a waiting group (``_run.groups.waiting``)
    counts to know when every rank has spoken."""
    if isinstance(message, RanksFinished):
        return message.ranks
    inner = message.message if isinstance(message, Sequenced) else message
    if isinstance(inner, (Result, Failure, Requeueing, Disconnected)):
        return (inner.rank,)
    return ()
