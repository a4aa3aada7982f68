"""A node's relay: the one connection between the kernel and a node's ranks.

Without it the kernel serves every rank: one connection, one Start and one report per
rank per cell, each sealed and checked, each a wake-up of its own. With it the kernel
sends a cell's Start once per node (``ToRanks``), and what the node's ranks send comes
back in batches (``FromRanks``): one frame, one check and one wake-up for whatever the
node's ranks said meanwhile. The relay is threads in the node's torchrun process
(``_rank.torchrun``), which waits on its ranks anyway: it costs no rank any time.

To its ranks the relay is the kernel: they connect to its socket, in the run's private
dir, with the run's key, as they would to the kernel's. To the kernel it is a rank whose
messages name many ranks. When the kernel's link closes, the relay closes its ranks'
links (a busy rank then stops, as it would were it connected to the kernel itself);
when the relay dies, its torchrun process died, and the ranks die with it (each rank
dies with its parent): the kernel sees every rank of the node disconnected.

A cluster session's ranks outlive their kernel, for a new one to attach (``attachable``).
Its relay does too (``reattach``): once its ranks' links are closed it waits for the
next kernel, connects to it, and only then listens for its ranks again; they connect
through it, greet the new kernel as they greeted the last, and the node keeps its one
connection. What a rank said to the kernel that went, read late, goes to none.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from .._wire.channel import Address, ChannelClient, ChannelServer
from .._wire.frames import encode
from .._wire.messages import Metrics, Present, Result, Sequenced
from .._wire.rank_stats import StatsColumns
from .._wire.relay_messages import (
    ForRank,
    FromRank,
    FromRanks,
    HeadListens,
    JoinTree,
    NodeMetrics,
    RanksFinished,
    RanksPresent,
    ToRanks,
    TreePlace,
)
from .._wire.transfer import Inbox, Outgoing, place_in
from .group_answers import WHOLE_WAIT, GroupAnswers

_BATCH_MOST = 1024  # messages in one batch: a frame stays small whatever the ranks say
_METRICS_WAIT = 0.05  # seconds a batch of metrics alone waits for the node's other ranks'
_GROUP_GAP = 0.002  # seconds a head's batch waits for the next of its group's reports
_GROUP_WAIT = 0.02  # ... and in all, at most
_PLACE_WAIT = 30.0  # seconds a relay waits to learn its place in a tree (its head's word)


Reattach = Callable[[Callable[[], bool]], ChannelClient | None]
"""How a relay reaches the next kernel that attaches: it waits for one, and connects to it
(None: none came, or the relay closed meanwhile, which the function it is given says)."""


class Ranks(Protocol):
    """The relay's side towards its node's ranks: where it hands them the kernel's
    messages (``ChannelServer``, ``HeadDown`` for a group's head, or a simulation of
    ranks: ``benchmarks/bench_nodes.py``)."""

    def send_encoded(self, rank: int, frame: bytes) -> bool: ...

    def send_frame_to_each(self, ranks: Iterable[int], frame: bytes) -> set[int]: ...

    def close(self) -> None: ...


class HeadDown:
    """A group's head relay's side towards its node's ranks and its group's relays
    (``_wire.relay_tree``): a message for ranks goes to those on this node, and once to
    each relay for the ranks behind it. A message with a data file for a rank behind
    another relay goes on to it with its file."""

    def __init__(self, ranks: Ranks, relays: ChannelServer) -> None:
        self.ranks, self.relays = ranks, relays

    def send_encoded(self, rank: int, frame: bytes) -> bool:
        return self.ranks.send_encoded(rank, frame) or self.relays.send_encoded(rank, frame)

    def send_frame_to_each(self, ranks: Iterable[int], frame: bytes) -> set[int]:
        missed = self.ranks.send_frame_to_each(ranks, frame)
        return self.relays.send_frame_to_each(missed, frame) if missed else missed

    def hand_on(self, message: ForRank) -> None:
        """``message`` came with a data file, which landed on this node: to its rank here,
        or on to the relay its rank is behind (the file goes with it, and leaves here).
        Where this node had no room for it (no ``file``), the rank is told so, as it
        would be on its own node."""
        if self.ranks.send_encoded(message.rank, encode(message.message)):
            return
        if not message.message.file:
            self.relays.send_encoded(message.rank, encode(message.message))
            return
        file = Path(message.message.file)
        try:
            self.relays.send(message.rank, message.message, Outgoing.of_file(file))
        finally:
            file.unlink(missing_ok=True)

    def close(self) -> None:
        self.relays.close()
        self.ranks.close()


class NodeRelay:
    """Speaks to the kernel over ``up`` for the ranks that ``ranks(deliver)`` makes,
    which hands it what they say."""

    def __init__(self, up: ChannelClient, ranks: Callable[[Callable[[Any], None]], Ranks],
                 landing: Landing | None = None, reattach: Reattach | None = None) -> None:
        """``reattach``, if given: once the kernel's link closes, wait for the next
        kernel and connect to it (``Reattach``)."""
        self._up, self._landing, self._ranks, self._reattach = up, landing, ranks, reattach
        self._outbox: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._answers = GroupAnswers()
        """Whom the relay handed the last Start (or roll call) to, and who has not said
        its end yet: their ends are held until then (``_gather``)."""
        self._kernel = 0  # which kernel the ranks' links speak to: one more each attach
        try:
            self._down = ranks(self._said_to(0))
        except BaseException:
            up.close()
            raise
        self._closing = threading.Lock()  # (and ``_kernel``, ``_up`` and ``_down`` change)
        self._closed = False
        self._sender = threading.Thread(target=self._send_up, daemon=True,
                                        name="nbddp-relay-up")
        self._sender.start()
        threading.Thread(target=self._hand_down, daemon=True, name="nbddp-relay-down").start()

    def _said_to(self, kernel: int) -> Callable[[Any], None]:
        """How the ranks' links of ``kernel`` (the relay's count) hand on what they say."""
        return lambda message: self._outbox.put((kernel, message))

    def _send_up(self) -> None:
        """Send what the ranks said, batched (``_gather``), to the kernel they said it to.
        Once closed, what was said before goes too, then the kernel's link closes. What
        was said to a kernel that went goes to no other (its data files are removed),
        and the relay goes on if it waits for the next."""
        while True:
            said = self._gather()
            with self._closing:
                kernel, up = self._kernel, self._up
            batch = [message for to, message in said if to == kernel or message is None]
            self._drop(message for to, message in said if to != kernel and message is not None)
            ends = said[-1][1] is None
            try:
                self._send_batch(compact(batch), up)
            except OSError:
                self._drop(batch)
                ends = ends or self._reattach is None or self._closed
            if ends:
                break
        self.close()
        self._up.close()

    def _send_batch(self, said: list[Any], up: ChannelClient) -> None:
        """``said`` in one frame, but for a message that came with a data file: it goes
        on alone with its file (``FromRank``), in its place among the others."""
        plain: list[Any] = []
        for message in said:
            file = self._file_of(message)
            if not file:
                plain.append(message)
                continue
            if plain:
                up.send(FromRanks(plain))
                plain = []
            try:
                up.send(FromRank(message), Outgoing.of_file(Path(file)))
            finally:
                Path(file).unlink(missing_ok=True)  # (the kernel has its own copy now)
        if plain:  # (the end alone says nothing)
            up.send(FromRanks(plain))

    def _drop(self, messages: Iterable[Any]) -> None:
        """Messages that go to no kernel: the data files they came with are removed."""
        for message in messages:
            file = self._file_of(message)
            if file:
                Path(file).unlink(missing_ok=True)

    def _file_of(self, message: Any) -> str:
        """The data file a rank's message came with, if any (landed in ``_landing``)."""
        inner = message.message if isinstance(message, Sequenced) else message
        file = getattr(inner, "file", None) or ""
        return file if self._landing is not None and self._landing.holds(file) else ""

    def _gather(self) -> list[tuple[int, Any]]:
        """The next batch, each message with the kernel it was said to: whatever waits
        once a message came. Metrics alone wait up to ``_METRICS_WAIT`` more for the
        node's other ranks' (each rank sends its own about ten times a second): they
        are reduced together. What the relay merges (ends of a run, answers to a roll
        call) waits for more: until every rank it handed the last Start (or roll call)
        to has said its end (up to ``WHOLE_WAIT``: see ``group_answers``), so that the
        node's ranks (or a head's group), ending apart, end in one message. A head that
        handed nothing yet waits a moment after each report instead (``_GROUP_GAP``):
        its group's relays report one after another."""
        batch = [self._outbox.get()]
        began = time.monotonic()
        answers = self._answers
        heads = isinstance(self._down, HeadDown)  # (as the batch begins)
        only_metrics = _is_metrics(batch[0][1])
        merged = _merges(batch[0][1])
        while True:
            answers.heard(batch[-1][1])  # (each message once, as it joins)
            if batch[-1][1] is None or len(batch) >= _BATCH_MOST:
                break
            try:
                batch.append(self._outbox.get_nowait())
            except queue.Empty:
                wait = _more_wait(began, only_metrics, merged, answers, heads)
                if wait <= 0:
                    break
                try:
                    batch.append(self._outbox.get(timeout=wait))
                except queue.Empty:
                    break
            only_metrics = only_metrics and _is_metrics(batch[-1][1])
            merged = merged and _merges(batch[-1][1])
        return batch

    def _hand_down(self) -> None:
        """Hand each of the kernel's messages to the ranks it is for, until the kernel's
        link closes; then close the ranks' links (and, with ``reattach``, serve the next
        kernel: again and again)."""
        while True:
            self._serve(self._up)
            if self._reattach is None or not self._next_kernel():
                break
        self.close()

    def _serve(self, up: ChannelClient) -> None:
        try:
            while True:
                self._hand_on(up.receive())
        except (ConnectionError, EOFError):
            pass

    def _hand_on(self, message: Any) -> None:
        """One of the kernel's messages to the ranks (or relays) it is for. One that
        cannot be handed on is said and dropped: the kernel's next ones still go (a
        relay that stopped reading would leave its ranks, and the kernel, waiting)."""
        try:
            if isinstance(message, ToRanks):
                self._hand_to_each(message.ranks, message.frame)
            elif isinstance(message, ForRank):  # (its data file is on this node)
                if isinstance(self._down, HeadDown):
                    self._down.hand_on(message)
                else:
                    self._down.send_encoded(message.rank, encode(message.message))
        except Exception as exc:  # noqa: BLE001 - said, and the relay goes on
            print(f"nbddp: this node's relay could not hand on a {type(message).__name__} "
                  f"({exc})", file=sys.stderr)

    def _hand_to_each(self, ranks: tuple[int, ...], frame: bytes) -> None:
        """``frame`` to each of ``ranks``; if it is a Start or a roll call, their ends (or
        answers) are awaited from now on, as they are heard (``_gather``)."""
        self._answers.expect(ranks, frame)  # (before a rank can answer)
        missed = self._down.send_frame_to_each(ranks, frame)
        if missed:
            self._answers.unreached(missed)

    def _next_kernel(self) -> bool:
        """The kernel went: close the ranks' links (they stop their run and wait for a
        kernel), connect to the next kernel, then listen for the ranks again. False if
        the relay closed meanwhile, or no kernel came, or the ranks' socket cannot be
        made again."""
        assert self._reattach is not None
        with self._closing:
            if self._closed:
                return False
            self._kernel += 1  # (what the old links still hand on goes nowhere)
            gone = self._down
        gone.close()
        self._up.close()
        up = self._reattach(lambda: self._closed)
        if up is None:
            return False
        with self._closing:
            if self._closed:
                up.close()
                return False
            try:
                self._down = self._ranks(self._said_to(self._kernel))
                self._answers = GroupAnswers()  # (the last kernel's run is nobody's now)
            except OSError as exc:
                print(f"nbddp: this node's relay cannot listen for its ranks again ({exc});"
                      " they reach no kernel", file=sys.stderr)
                up.close()
                return False
            self._up = up
        return True

    def close(self, wait: float = 0.0) -> None:
        """Close the ranks' links; what they said goes to the kernel, then its link
        closes (``wait``: up to that many seconds, for the torchrun that ends)."""
        with self._closing:
            if not self._closed:
                self._closed = True
                self._down.close()
                self._outbox.put((self._kernel, None))
        if wait and threading.current_thread() is not self._sender:
            self._sender.join(wait)


class Landing:
    """Where the data files a relay's ranks send (results, on a cluster's node whose
    kernel is elsewhere) land on their way to the kernel: folders of the relay's own, in
    shared memory where a file fits, else on disk. What lands there is sent on, then
    removed; a message's ``file`` elsewhere (a node's copy of a payload, named to the
    kernel) is only a name."""

    def __init__(self, shm: Path | None, disk: Path) -> None:
        self.folders = [folder for folder in (shm, disk) if folder is not None]
        for folder in self.folders:
            folder.mkdir(mode=0o700, exist_ok=True)
        self.inbox = place_in(shm, disk)

    def holds(self, file: str) -> bool:
        return bool(file) and Path(file).parent in self.folders


def node_relay(kernel: Address, listen: Path, key: bytes, inbox: Inbox | None = None,
               landing: Landing | None = None, reattach: Reattach | None = None,
               tree: bool = False) -> NodeRelay:
    """The relay of this node's ranks, which connect to ``listen`` with ``key``, to the
    kernel at ``kernel``. On a cluster's node (the kernel elsewhere) data files cross it
    both ways: a payload from the kernel lands in ``inbox`` for a rank to keep, and a
    rank's result lands in ``landing`` on its way to the kernel. ``reattach``: how it
    reaches the next kernel, when one attaches (``NodeRelay``). ``tree``: the kernel
    arranges the nodes' relays as a tree (``placed_relay``)."""
    files = landing.inbox if landing else None
    return placed_relay(lambda: ChannelClient(kernel, key, inbox), key,
                        lambda deliver: ChannelServer(listen, key, deliver, files),
                        inbox=inbox, landing=landing, reattach=reattach, tree=tree)


def placed_relay(connect: Callable[[], ChannelClient], key: bytes,
                 ranks: Callable[[Callable[[Any], None]], Ranks], *,
                 inbox: Inbox | None = None, landing: Landing | None = None,
                 reattach: Reattach | None = None, tree: bool = False) -> NodeRelay:
    """The relay of the ranks ``ranks(deliver)`` makes, on a link to the kernel that
    ``connect`` makes (as ``node_relay``'s). ``tree``: it first asks the kernel for its
    place in the tree of relays (``_wire.relay_tree``): it may speak through its group's
    head instead, or head a group, whose relays then connect to it as well as its
    ranks."""
    up, heads = _place_in_tree(connect, key, inbox) if tree else (connect(), False)
    files = landing.inbox if landing else None
    group: ChannelServer | None = None  # (a head's: where its group's relays connect)
    heading = heads  # (a next kernel's relays join it each on a link of its own)

    def ranks_and_relays(deliver: Callable[[Any], None]) -> Ranks:
        nonlocal group, heading
        here = ranks(deliver)
        if not heading:
            return here
        heading = False
        try:
            group = ChannelServer((up.local_host, 0), key, deliver, files)
        except OSError as exc:
            print(f"nbddp: this node's relay cannot listen for its group's relays ({exc}); "
                  "they speak to the kernel themselves", file=sys.stderr)
            return here
        return HeadDown(here, group)

    relay = NodeRelay(up, ranks_and_relays, landing, reattach)
    if heads:
        with contextlib.suppress(OSError):  # (the kernel went: the relay's end says so)
            up.send(HeadListens((up.local_host, group.port or 0) if group else None))
    return relay


def _place_in_tree(connect: Callable[[], ChannelClient], key: bytes, inbox: Inbox | None
                   ) -> tuple[ChannelClient, bool]:
    """Ask the kernel (on a link ``connect`` makes) for this relay's place in the tree of
    relays: the link it speaks on (the kernel's, or its group's head's), and whether it
    heads a group. A relay that cannot reach its head, or is told nothing in
    ``_PLACE_WAIT`` seconds (its head asked, and hangs), stays on a kernel link of its
    own."""
    up = connect()
    try:
        up.send(JoinTree())
        place = up.receive(timeout=_PLACE_WAIT)
    except ConnectionError as exc:
        up.close()
        print(f"nbddp: this node's relay was given no place among the relays ({exc}); it "
              "speaks to the kernel itself", file=sys.stderr)
        return connect(), False
    if not isinstance(place, TreePlace):
        up.close()
        raise ConnectionError(f"the kernel sent a {type(place).__name__} where this "
                              "node's relay asked for its place")
    if place.parent is None:
        return up, place.listen
    try:
        head = ChannelClient(place.parent, key, inbox)
    except OSError as exc:
        print(f"nbddp: this node's relay cannot reach its group's head at "
              f"{place.parent[0]}:{place.parent[1]} ({exc}); it speaks to the kernel itself",
              file=sys.stderr)
        return up, False
    up.close()
    return head, False


def _more_wait(began: float, only_metrics: bool, merged: bool, answers: GroupAnswers,
               heads: bool) -> float:
    """How much longer a batch begun at ``began`` waits for the next message: none once
    every rank handed the last Start (or roll call) has said its end."""
    now = time.monotonic()
    if only_metrics:
        return began + _METRICS_WAIT - now
    if not merged or answers.answered():
        return 0.0
    if answers.awaited():
        return began + WHOLE_WAIT - now
    return min(_GROUP_GAP, began + _GROUP_WAIT - now) if heads else 0.0


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


def _merges(message: Any) -> bool:
    """``message`` is one that a batch says once for many ranks (``compact``)."""
    return _group_of(message) is not None


def _is_metrics(message: Any) -> bool:
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
                and inner.assigned is None:
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
