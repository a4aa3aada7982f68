"""What the kernel and the ranks tell each other, and the one way it is framed.

Every message is a small frozen dataclass. A frame is an 8-byte length and the pickled
message; the channel's sockets and the start file carry these frames (a mailbox file
marks and checksums each message instead: ``_wire.mailbox``). Frames are only decoded from
authenticated peers or from private (0600) files.
Tensor and array bytes do not travel in messages: they are in data files (``_wire.dataplane``)
that a message names; to and from another machine, the file goes along with the message
(``_wire.transfer``).

    rank -> kernel   Hello, Ready, Present, Metrics, RankStats, StepTimes, StopRequested,
                     DebugPrompt, DebugDone, Assigned, Stacks, Collectives, PayloadKept,
                     OutputBytes, and a report:
                     Result, Failure or Requeueing (each Sequenced)
    kernel -> rank   RollCall, KeepPayload, Start, DebugInput, Interrupt, ShowStacks,
                     ShowCollectives
    kernel only      Disconnected (a rank's connection closed)
    relay <-> kernel ToRanks and ForRank (down), FromRanks and FromRank (up): a node's
                     ranks' messages, batched by the node's relay (``_rank.relay``),
                     with RanksPresent, RanksFinished and NodeMetrics for what many of
                     them said alike; past many nodes the same between a group's head
                     and its group's relays (a head merges its group's batches), and
                     JoinTree, HeadListens (up) and TreePlace (down) to form the tree
                     (``_wire.relay_tree``)
"""

from __future__ import annotations

import pickle
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple

_HEADER = struct.Struct("!Q")  # any length
HEADER_SIZE = _HEADER.size


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
class Stacks:
    """A rank's answer to ``ShowStacks``: faulthandler's dump of its threads (None if it
    did not come), and which thread is the rank's main one."""

    rank: int
    call: int
    dump: str | None
    main: str | None


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
class ShowStacks:
    """Send back every thread's stack (``Stacks``): how the kernel asks a rank on
    another machine, which it cannot signal."""

    call: int
    """Which request: an answer to an earlier one does not count."""


@dataclass(frozen=True)
class ShowCollectives:
    """Send back where this rank is in its collectives (``Collectives``)."""

    call: int
    """Which request: an answer to an earlier one does not count."""


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


# --- through a node's relay -----------------------------------------------------------


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
    (its rank will say nothing more). What a relay (``_rank.group_answers``) and a
    waiting group (``_run.waiting``) count to know when every rank has spoken."""
    if isinstance(message, RanksFinished):
        return message.ranks
    inner = message.message if isinstance(message, Sequenced) else message
    if isinstance(inner, (Result, Failure, Requeueing, Disconnected)):
        return (inner.rank,)
    return ()


# --- frames ---------------------------------------------------------------------------


def encode(message: Any) -> bytes:
    """One frame: the length, then the pickled message."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def body_size(header: bytes) -> int:
    """The length a frame's header announces."""
    return _HEADER.unpack(header)[0]


def decode(body: bytes | memoryview) -> Any:
    """The message in a frame's body."""
    return pickle.loads(body)


def split_frames(data: bytes) -> tuple[list[bytes], int]:
    """The bodies of the complete frames at the start of ``data``, and the bytes they use."""
    bodies, used = [], 0
    while len(data) - used >= HEADER_SIZE:
        end = used + HEADER_SIZE + body_size(data[used:used + HEADER_SIZE])
        if end > len(data):
            break  # the rest of this frame is still being written
        bodies.append(data[used + HEADER_SIZE:end])
        used = end
    return bodies, used


def pickled(message: Any) -> bytes:
    """A message's bytes without a frame's length: what a mailbox frame carries, behind
    a marker and a checksum of its own (``_wire.mailbox``)."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
