"""A tree of relays (``_wire.relay_tree``) between a real kernel-side ``ChannelServer`` and
nodes' relays with ranks' ``ChannelClient``s, over real TCP links with the run's key: the
kernel places the relays, speaks to one per group, hears the group's ranks in merged
batches (the mean of their metrics exact), and learns of every rank that goes; a relay
that cannot reach its head, or reaches an impostor, stays on the kernel's link."""

from __future__ import annotations

import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nbddp._rank.node_metrics import merged
from nbddp._rank.relay_compact import compact
from nbddp._rank.relay_placement import node_relay
from nbddp._wire.channel import ChannelClient, ChannelServer
from nbddp._wire.handshake import MAGIC, new_key
from nbddp._wire.history import History
from nbddp._wire.messages import (
    Disconnected,
    Metrics,
    Present,
    Ready,
    Result,
    RollCall,
    Sequenced,
    Start,
)
from nbddp._wire.rank_stats import RankStats, StatsColumns
from nbddp._wire.relay_messages import (
    HeadListens,
    JoinTree,
    NodeMetrics,
    RanksFinished,
    RanksPresent,
    TreePlace,
)
from nbddp._wire.relay_tree import RelayTree, group_size, uses_tree

from .conftest import wait_until
from .test_relay import _frames_sent

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast

NODES = 4  # groups of 2: two heads, each with one other relay
PER_NODE = 2


class Kernel:
    """The kernel's end: a real TCP server that places relays in a tree; what it
    delivers."""

    def __init__(self, key: bytes, nodes: int = NODES, inbox=None) -> None:
        self.delivered: queue.SimpleQueue = queue.SimpleQueue()
        self.server = ChannelServer(("127.0.0.1", 0), key, self.delivered.put, inbox=inbox,
                                    tree=RelayTree(nodes))
        self.address = ("127.0.0.1", self.server.port)

    def take(self, count: int, timeout: float = 10.0) -> list:
        deadline = time.monotonic() + timeout
        return [self.delivered.get(timeout=max(0.01, deadline - time.monotonic()))
                for _ in range(count)]

    def until(self, done, timeout: float = 10.0) -> list:
        """What it delivers until ``done(everything so far)``."""
        found: list = []
        deadline = time.monotonic() + timeout
        while not done(found):
            found.append(self.delivered.get(timeout=max(0.01, deadline - time.monotonic())))
        return found

    def links(self) -> int:
        """The links its ranks are reached by."""
        return len({id(route.link) for route in self.server._peers.values()})


def private_folder(tmp_path: Path) -> Path:
    folder = Path(os.path.realpath(tmp_path))
    folder.chmod(0o700)
    return folder


def ranks_of(node: int) -> range:
    return range(node * PER_NODE, (node + 1) * PER_NODE)


@pytest.fixture
def tree(tmp_path):
    """Four nodes' relays placed by the kernel (each made in turn, as nodes start), each
    with its two ranks connected and said ready."""
    folder = private_folder(tmp_path)
    key = new_key()
    kernel = Kernel(key)
    relays, ranks = [], []
    try:
        for node in range(NODES):
            relays.append(node_relay(kernel.address, folder / f"relay{node}.sock", key,
                                     tree=True))
            ranks += [ChannelClient(folder / f"relay{node}.sock", key) for _ in range(PER_NODE)]
        for number, rank in enumerate(ranks):
            rank.send(Sequenced(0, Ready(number)))
        assert sorted(message.rank for message in kernel.take(len(ranks))) == \
            list(range(len(ranks)))
        yield kernel, relays, ranks
    finally:
        close_all(ranks, relays, kernel.server)


def close_all(ranks, relays, *servers: ChannelServer) -> None:
    for rank in ranks:
        rank.close()
    for relay in relays:
        relay.close()
    for server in servers:
        server.close()


def stats(rank: int) -> RankStats:
    return RankStats(rank, f"node{rank // PER_NODE}", 100 + rank, None, 1.0 + rank, None, 0)


def test_the_kernel_speaks_to_one_relay_per_group_and_every_rank_hears_it(tree):
    kernel, _, ranks = tree
    assert kernel.links() == NODES // group_size(NODES) == 2
    start = Start("v", "records", "payload", options=None)  # type: ignore[arg-type]
    sent = _frames_sent(kernel.server)
    assert kernel.server.send_to_each(range(len(ranks)), start) == set()
    assert _frames_sent(kernel.server) - sent == 2  # one frame for each group of four ranks
    for rank in ranks:
        assert rank.receive() == start


def test_a_group_s_ends_and_metrics_come_merged_and_the_mean_is_exact(tree):
    kernel, _, ranks = tree
    steps = 5
    for number, rank in enumerate(ranks):
        rank.send(Sequenced(1, Metrics(number, [(step, {"loss": number * 10.0 + step})
                                                for step in range(steps)])))
        rank.send(Sequenced(2, Result(number, stats=stats(number))))

    def every_rank_finished(found: list) -> bool:
        done = [rank for m in found if isinstance(m, RanksFinished) for rank in m.ranks]
        return sorted(done) == list(range(len(ranks)))

    came = kernel.until(every_rank_finished)
    assert all(isinstance(message, (RanksFinished, NodeMetrics)) for message in came), came
    assert len(came) < 2 * len(ranks)  # (merged: fewer than a message per rank and kind)
    finished = [m for m in came if isinstance(m, RanksFinished)]
    rows = {row.rank: row for m in finished for row in m.stats.rows()}
    assert rows == {rank: stats(rank) for rank in range(len(ranks))}
    history = History(len(ranks))
    for message in came:
        if isinstance(message, NodeMetrics):
            history.add_reduced(message.partials)
    assert history.series["loss"] == [
        (step, sum(rank * 10.0 + step for rank in range(len(ranks))) / len(ranks))
        for step in range(steps)]


def _answer(kind: str, rank: int, seq: int):
    return Sequenced(seq, Result(rank, stats=stats(rank)) if kind == "Start"
                     else Present(rank, 7))


def _answered(kind: str, found: list) -> list[int]:
    """The ranks ``found`` holds the ends (or roll call answers) of."""
    merged = RanksFinished if kind == "Start" else RanksPresent
    return sorted(rank for m in found if isinstance(m, merged) for rank in m.ranks)


def handed(kernel: Kernel, ranks, parts, kind: str = "Start") -> None:
    """Send a Start (or a roll call) to each of ``parts`` (lists of ranks) in turn; every
    rank has it."""
    message = Start("v", "records", "payload", options=None) if kind == "Start" \
        else RollCall(7)  # type: ignore[arg-type]
    for part in parts:
        assert kernel.server.send_to_each(part, message) == set()
    for rank in sorted(rank for part in parts for rank in part):
        assert ranks[rank].receive() == message


def test_a_head_sends_its_group_s_ends_without_a_rank_that_stays_silent(tree):
    """One rank of the first group does not end: the others' ends reach the kernel all
    the same, and the silent rank's end follows when it comes."""
    kernel, _, ranks = tree
    handed(kernel, ranks, [range(len(ranks))])
    silent = 3  # (node 1's second rank: node 1 speaks through node 0, the group's head)
    for number, rank in enumerate(ranks):
        if number != silent:
            rank.send(_answer("Start", number, 1))
    others = [rank for rank in range(len(ranks)) if rank != silent]
    kernel.until(lambda found: _answered("Start", found) == others)
    ranks[silent].send(_answer("Start", silent, 1))
    assert _answered("Start", kernel.take(1)) == [silent]


RELAY_PROCESS = """
import sys, time
from pathlib import Path
from nbddp._rank.relay_placement import node_relay
folder, port = Path(sys.argv[1]), int(sys.argv[2])
node_relay(("127.0.0.1", port), folder / sys.argv[3], (folder / "key").read_bytes(),
           tree=True)
print("up", flush=True)
time.sleep(600)
"""


def relay_process(folder: Path, kernel: Kernel, socket_name: str) -> subprocess.Popen:
    """A node's relay in a process of its own (to be killed), placed by the kernel."""
    process = subprocess.Popen([sys.executable, "-c", RELAY_PROCESS, str(folder),
                                str(kernel.address[1]), socket_name],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "up\n"
    return process


@pytest.mark.parametrize("killed", ["head", "member"])
def test_a_relay_killed_loses_its_ranks_and_a_head_its_group_the_other_group_goes_on(
        tmp_path, killed):
    """Node 0 heads the first group, node 1 is its other relay (node 2 heads the second,
    node 3 is in it). Killing node 1's relay loses its ranks; killing node 0's loses the
    whole first group's (the kernel reaches node 1 through it). Node 2's and 3's ranks go
    on being reached."""
    folder = private_folder(tmp_path)
    key = new_key()
    (folder / "key").write_bytes(key)
    kernel = Kernel(key)
    victim = 0 if killed == "head" else 1
    relays, ranks, process = [], [], None
    try:
        for node in range(NODES):
            name = f"relay{node}.sock"
            if node == victim:
                process = relay_process(folder, kernel, name)
            else:
                relays.append(node_relay(kernel.address, folder / name, key, tree=True))
            ranks += [ChannelClient(folder / name, key) for _ in range(PER_NODE)]
        for number, rank in enumerate(ranks):
            rank.send(Sequenced(0, Ready(number)))
        kernel.take(len(ranks))
        assert process is not None
        process.kill()
        process.wait()
        lost = {*ranks_of(0), *ranks_of(1)} if killed == "head" else set(ranks_of(1))
        gone = kernel.take(len(lost))
        assert {(m.rank, m.relay_lost) for m in gone} == {(rank, True) for rank in lost}
        assert all(isinstance(m, Disconnected) for m in gone)
        start = Start("v", "records", "payload", options=None)  # type: ignore[arg-type]
        assert kernel.server.send_to_each(range(len(ranks)), start) == lost
        for number in set(range(len(ranks))) - lost:
            assert ranks[number].receive() == start
    finally:
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
        close_all(ranks, relays, kernel.server)


def join_as_head(kernel: Kernel, key: bytes, listens: tuple[str, int] | None
                 ) -> ChannelClient:
    """A peer holding the key that joins first (so heads the first group) and says it
    listens at ``listens`` (None: says nothing)."""
    head = ChannelClient(kernel.address, key)
    head.send(JoinTree())
    assert head.receive(timeout=10) == TreePlace(listen=True)
    if listens is not None:
        head.send(HeadListens(listens))
    return head


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_stays_on_the_kernel_s_link(kernel: Kernel, relay_socket: Path, key: bytes) -> None:
    """The relay's ranks reach the kernel on a link of the relay's own (not the head's)."""
    rank = ChannelClient(relay_socket, key)
    try:
        rank.send(Sequenced(0, Ready(7)))
        assert kernel.take(1) == [Sequenced(0, Ready(7))]
        assert kernel.links() == 1 and kernel.server.send(7, Ready(0))
        assert rank.receive() == Ready(0)
    finally:
        rank.close()


@pytest.mark.parametrize("head_says", ["an address that refuses", "nothing, and hangs"])
def test_a_relay_that_cannot_reach_its_head_stays_on_a_kernel_link_of_its_own(
        tmp_path, monkeypatch, capfd, head_says):
    """Its head said where it listens, and nothing answers there; or its head asked for
    its place and then said nothing (its link open): the relay waits ``_PLACE_WAIT``."""
    import nbddp._rank.relay_placement

    monkeypatch.setattr(nbddp._rank.relay_placement, "_PLACE_WAIT", 1.0)
    folder = private_folder(tmp_path)
    key = new_key()
    kernel = Kernel(key)
    refusing = head_says == "an address that refuses"
    head = join_as_head(kernel, key, ("127.0.0.1", closed_port()) if refusing else None)
    relay = node_relay(kernel.address, folder / "relay.sock", key, tree=True)
    try:
        check_stays_on_the_kernel_s_link(kernel, folder / "relay.sock", key)
        said = "cannot reach its group's head" if refusing else \
            "was given no place among the relays"
        assert said in capfd.readouterr().err
    finally:
        close_all([head], [relay], kernel.server)


def test_a_group_whose_head_went_before_it_said_where_stays_on_the_kernel_s_link(tmp_path):
    folder = private_folder(tmp_path)
    key = new_key()
    kernel = Kernel(key)
    head = join_as_head(kernel, key, None)
    placed: queue.SimpleQueue = queue.SimpleQueue()
    joining = threading.Thread(target=lambda: placed.put(node_relay(
        kernel.address, folder / "relay.sock", key, tree=True)))
    joining.start()
    time.sleep(0.5)
    assert placed.empty()  # (it waits for its head's word)
    head.close()
    joining.join(timeout=10)
    relay = placed.get(timeout=1)
    try:
        check_stays_on_the_kernel_s_link(kernel, folder / "relay.sock", key)
    finally:
        close_all([], [relay], kernel.server)


class Impostor:
    """A listener without the run's key where a head was said to be: it speaks the
    channel's greeting, reads what a relay that connects says, and answers with a proof
    it makes up."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.address = self.sock.getsockname()
        self.heard = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        peer, _ = self.sock.accept()
        with peer:
            peer.sendall(MAGIC + secrets.token_bytes(32))
            peer.settimeout(10)
            self.heard = peer.recv(4096)
            peer.sendall(secrets.token_bytes(32))  # (a "proof" without the key)
            while chunk := peer.recv(4096):
                self.heard += chunk

    def close(self) -> None:
        self.sock.close()
        self.thread.join(timeout=10)


def test_a_relay_sent_to_an_impostor_tells_it_nothing_and_stays_on_the_kernel_s_link(
        tmp_path):
    """(Where a head's address is taken over by someone without the key: the relay's
    handshake fails on the impostor's proof, before the relay sends it a frame.)"""
    folder = private_folder(tmp_path)
    key = new_key()
    kernel = Kernel(key)
    impostor = Impostor()
    head = join_as_head(kernel, key, impostor.address)
    relay = node_relay(kernel.address, folder / "relay.sock", key, tree=True)
    try:
        check_stays_on_the_kernel_s_link(kernel, folder / "relay.sock", key)
        impostor.thread.join(timeout=10)
        assert len(impostor.heard) == 64  # the relay's nonce and proof: nothing more
        assert key not in impostor.heard
    finally:
        impostor.close()
        close_all([head], [relay], kernel.server)


def test_a_stranger_without_the_key_is_refused_by_a_head_and_the_group_goes_on(tree):
    kernel, relays, ranks = tree
    head = next(relay for relay in relays if hasattr(relay._down, "relays"))
    port = head._down.relays.port
    with pytest.raises(ConnectionError):
        ChannelClient(("127.0.0.1", port), new_key())
    start = Start("v", "records", "payload", options=None)  # type: ignore[arg-type]
    assert kernel.server.send_to_each(range(len(ranks)), start) == set()
    for rank in ranks:
        assert rank.receive() == start


@pytest.fixture
def cluster_tree(tmp_path):
    """Two nodes of a cluster whose kernel is elsewhere (TCP, data files both ways), node
    0 heading, node 1 behind it: each with an inbox for the kernel's files and a landing
    for its ranks', and a rank each."""
    from nbddp._rank.relay import Landing
    from nbddp._wire.transfer import place_in

    folder = private_folder(tmp_path)
    for name in ("kernel-in", "in0", "in1"):
        (folder / name).mkdir(mode=0o700)
    key = new_key()
    kernel = Kernel(key, nodes=2, inbox=place_in(None, folder / "kernel-in"))
    relays, ranks = [], []
    try:
        for node in range(2):
            relays.append(node_relay(kernel.address, folder / f"relay{node}.sock", key,
                                     inbox=place_in(None, folder / f"in{node}"),
                                     landing=Landing(None, folder / f"landing{node}"),
                                     tree=True))
            ranks.append(ChannelClient(folder / f"relay{node}.sock", key))
        for number, rank in enumerate(ranks):
            rank.send(Sequenced(0, Ready(number)))
        kernel.take(2)
        assert kernel.links() == 1
        yield kernel, ranks, folder
    finally:
        close_all(ranks, relays, kernel.server)


def test_a_payload_for_a_rank_behind_a_head_lands_on_its_own_node_only(cluster_tree):
    import torch

    from nbddp._wire import dataplane
    from nbddp._wire.messages import KeepPayload
    from nbddp._wire.transfer import PIECE, Outgoing

    kernel, ranks, folder = cluster_tree
    value = torch.arange((PIECE + 4000) // 4, dtype=torch.int32)
    assert kernel.server.send(1, KeepPayload(), Outgoing(dataplane.pack({"x": value})))
    kept = ranks[1].receive()
    assert isinstance(kept, KeepPayload) and Path(kept.file).parent == folder / "in1"
    assert torch.equal(dataplane.read(Path(kept.file)).load()["x"], value)
    wait_until(lambda: list((folder / "in0").iterdir()) == [],  # (went on, and left)
               timeout=10)


def test_a_payload_the_head_s_node_has_no_room_for_reaches_the_rank_behind_it_as_such(
        cluster_tree):
    """(No room on the head's node: the rank is told so, and reads the payload as a rank
    on a full node does; the head goes on handing on what comes next.)"""
    from nbddp._wire import dataplane
    from nbddp._wire.messages import KeepPayload
    from nbddp._wire.transfer import Outgoing

    kernel, ranks, folder = cluster_tree
    (folder / "in0").rmdir()  # (the head's node has nowhere to put it)
    assert kernel.server.send(1, KeepPayload(), Outgoing(dataplane.pack({"x": b"y" * 10})))
    assert ranks[1].receive() == KeepPayload(file="")
    start = Start("v", "records", "payload", options=None)  # type: ignore[arg-type]
    assert kernel.server.send_to_each(range(2), start) == set()
    assert ranks[0].receive() == start and ranks[1].receive() == start


def test_a_result_file_from_behind_a_head_reaches_the_kernel_and_leaves_both_nodes(
        cluster_tree):
    import torch

    from nbddp._wire import dataplane
    from nbddp._wire.transfer import Outgoing

    kernel, ranks, folder = cluster_tree
    value = torch.arange(2**20, dtype=torch.int32)
    ranks[1].send(Sequenced(1, Result(1)), Outgoing(dataplane.pack({"x": value})))
    (result,) = kernel.take(1)
    assert result.seq == 1 and Path(result.message.file).parent == folder / "kernel-in"
    assert torch.equal(dataplane.read(Path(result.message.file)).load()["x"], value)
    wait_until(lambda: list((folder / "landing0").iterdir()) ==  # (removed once sent on)
               list((folder / "landing1").iterdir()) == [], timeout=10)


# --- pure logic -------------------------------------------------------------------------


def test_a_head_merges_its_group_s_batches_each_rank_s_messages_in_order():
    node_a = RanksFinished((0, 1), StatsColumns.of([stats(0), stats(1)]))
    node_b = RanksFinished((2, 3), StatsColumns.of([stats(2), stats(3)]))
    own = Sequenced(4, Result(4, stats=stats(4)))
    later = Disconnected(3)  # (rank 3 goes after it finished: its end comes first)
    after = RanksFinished((5,), StatsColumns.of([stats(5)]))
    assert compact([node_a, own, node_b, later, after]) == [
        RanksFinished((0, 1, 2, 3, 4), StatsColumns.of([stats(r) for r in (0, 1, 2, 3, 4)])),
        later, after]


def test_merged_metrics_add_sums_and_counts_and_keep_a_rank_s_second_report_apart():
    one = NodeMetrics([(1, (0, 1), {"loss": (3.0, 2)})], {0: (1, None, None)}, [])
    two = NodeMetrics([(1, (2,), {"loss": (5.0, 1), "acc": (0.5, 1)})], {2: (1, 9, "x")},
                      [(2, [(1, {"lr": 0.1})])])
    again = NodeMetrics([(1, (0,), {"loss": (7.0, 1)})], {}, [])  # rank 0 sent step 1 again
    result = merged([one, two, again], attempt=1)
    assert result.partials == [(1, (0, 1, 2), {"loss": (8.0, 3), "acc": (0.5, 1)}),
                               (1, (0,), {"loss": (7.0, 1)})]
    assert result.positions == {0: (1, None, None), 2: (1, 9, "x")}
    assert result.for_all == [(2, [(1, {"lr": 0.1})])] and result.attempt == 1


class RecordingLink:
    def __init__(self) -> None:
        self.said: list = []

    def send(self, message) -> None:
        self.said.append(message)


def test_the_kernel_places_relays_in_groups_in_the_order_they_ask():
    tree = RelayTree(9)  # groups of 3
    links = [RecordingLink() for _ in range(7)]
    for link in links[:4]:
        tree.take(link, JoinTree())
    assert links[0].said == links[3].said == [TreePlace(listen=True)]
    assert links[1].said == links[2].said == []  # (they wait for their head's word)
    tree.take(links[0], HeadListens(("10.0.0.1", 5000)))
    assert links[1].said == links[2].said == [TreePlace(parent=("10.0.0.1", 5000))]
    tree.take(links[4], JoinTree())
    tree.ended(links[3])  # (a head gone before it said where it listens)
    assert links[4].said == [TreePlace()]
    tree.take(links[5], JoinTree())
    assert links[5].said == [TreePlace()]
    tree.take(links[6], JoinTree())
    assert links[6].said == [TreePlace(listen=True)]  # (the next group's head)
    tree.take(links[1], HeadListens(("10.9.9.9", 1)))  # (no head: nothing changes)
    assert tree.take(links[1], Ready(0)) is False


def test_a_session_forms_a_tree_from_many_nodes(monkeypatch):
    from nbddp._run.config import relay_option, relay_tree

    monkeypatch.delenv("NBDDP_RELAY_TREE_FROM", raising=False)
    assert not uses_tree(63) and uses_tree(64)
    assert relay_option(8, 32) == ["--relay"] and relay_tree(8, 32) is None
    assert relay_option(8, 64) == ["--relay", "--relay-tree"]
    assert isinstance(relay_tree(8, 64), RelayTree)
    assert relay_option(2, 1024) == []  # (no relay, no tree)
    assert [group_size(n) for n in (2, 4, 64, 1024, 1025)] == [2, 2, 8, 32, 33]
    monkeypatch.setenv("NBDDP_RELAY_TREE_FROM", "2")
    assert relay_option(4, 2) == ["--relay", "--relay-tree"]
