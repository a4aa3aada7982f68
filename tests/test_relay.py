"""A node's relay (``_rank.relay``) between a real kernel-side ``ChannelServer`` and
ranks' ``ChannelClient``s, over real sockets with the run's key: the kernel sends once
per node, hears the node's ranks in batches, and learns of every rank that goes."""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nbddp._rank.node_metrics import reduced
from nbddp._rank.relay_compact import compact
from nbddp._rank.relay_placement import node_relay
from nbddp._wire.channel import ChannelClient, ChannelServer
from nbddp._wire.handshake import new_key
from nbddp._wire.messages import (
    Disconnected,
    Metrics,
    Present,
    Ready,
    Requeueing,
    Result,
    RollCall,
    Sequenced,
    Start,
)
from nbddp._wire.rank_stats import RankStats, StatsColumns
from nbddp._wire.relay_messages import NodeMetrics, RanksFinished, RanksPresent

from .conftest import wait_until

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


class Kernel:
    """The kernel's end: a real server; what it delivers, and every frame it received."""

    def __init__(self, folder: Path, key: bytes) -> None:
        self.delivered: queue.SimpleQueue = queue.SimpleQueue()
        self.server = ChannelServer(folder / "channel.sock", key, self.delivered.put)

    def take(self, count: int, timeout: float = 10.0) -> list:
        deadline = time.monotonic() + timeout
        found = []
        while len(found) < count:
            found.append(self.delivered.get(timeout=max(0.01, deadline - time.monotonic())))
        return found


@pytest.fixture
def node(tmp_path):
    folder = Path(os.path.realpath(tmp_path))
    folder.chmod(0o700)
    key = new_key()
    kernel = Kernel(folder, key)
    relay = node_relay(kernel.server.address, folder / "relay.sock", key)
    ranks = [ChannelClient(folder / "relay.sock", key) for _ in range(4)]
    try:
        yield kernel, relay, ranks
    finally:
        close_all(ranks, relay, kernel.server)


def close_all(ranks: list[ChannelClient], relay, *servers: ChannelServer) -> None:
    """The ranks' links, then the relay, then the kernels' servers."""
    for rank in ranks:
        rank.close()
    relay.close()
    for server in servers:
        server.close()


def say(rank: ChannelClient, number: int, message, seq: int = 0) -> None:
    """Rank ``number`` sends ``message``, numbered as a rank's link numbers them."""
    rank.send(Sequenced(seq, message))


def test_the_ranks_messages_reach_the_kernel_as_each_rank_sent_them(node):
    kernel, _, ranks = node
    for number, rank in enumerate(ranks):
        say(rank, number, Ready(number))
    got = kernel.take(4)
    assert sorted(message.message.rank for message in got) == [0, 1, 2, 3]
    assert {type(message.message) for message in got} == {Ready}


def test_the_kernel_sends_once_for_the_node_and_every_rank_gets_it(node):
    kernel, _, ranks = node
    for number, rank in enumerate(ranks):
        say(rank, number, Ready(number))
    kernel.take(4)
    start = Start("v", "records", "payload", options=None)  # type: ignore[arg-type]
    sent_before = _frames_sent(kernel.server)
    assert kernel.server.send_to_each(range(4), start) == set()
    assert _frames_sent(kernel.server) - sent_before == 1  # one frame for the four ranks
    for rank in ranks:
        assert rank.receive() == start
    assert kernel.server.send(2, RollCall(5))
    assert ranks[2].receive() == RollCall(5)


def _frames_sent(server: ChannelServer) -> int:
    """Frames the kernel's links have sent, in all."""
    links = {id(route.link): route.link for route in server._peers.values()}
    return sum(link._sent for link in links.values())


def test_a_rank_that_goes_is_disconnected_and_is_reached_no_more(node):
    kernel, _, ranks = node
    for number, rank in enumerate(ranks):
        say(rank, number, Ready(number))
    kernel.take(4)
    ranks[1].close()
    assert kernel.take(1) == [Disconnected(1)]
    assert kernel.server.send_to_each(range(4), RollCall(1)) == {1}
    assert not kernel.server.send(1, RollCall(1))


RELAY_PROCESS = """
import sys, time
from pathlib import Path
from nbddp._rank.relay_placement import node_relay
folder = Path(sys.argv[1])
node_relay(folder / "channel.sock", folder / "relay.sock", (folder / "key").read_bytes())
print("up", flush=True)
time.sleep(600)
"""


def test_a_relay_killed_disconnects_every_rank_it_spoke_for_as_lost_with_it(tmp_path):
    folder = Path(os.path.realpath(tmp_path))
    folder.chmod(0o700)
    key = new_key()
    (folder / "key").write_bytes(key)
    kernel = Kernel(folder, key)
    relay = subprocess.Popen([sys.executable, "-c", RELAY_PROCESS, str(folder)],
                             stdout=subprocess.PIPE, text=True)
    ranks: list[ChannelClient] = []
    try:
        assert relay.stdout is not None and relay.stdout.readline() == "up\n"
        ranks = [ChannelClient(folder / "relay.sock", key) for _ in range(4)]
        for number, rank in enumerate(ranks):
            say(rank, number, Ready(number))
        kernel.take(4)
        relay.kill()
        gone = kernel.take(4)
        assert sorted(event.rank for event in gone) == [0, 1, 2, 3]
        assert all(isinstance(event, Disconnected) and event.relay_lost for event in gone)
        for rank in ranks:  # and each rank sees its kernel gone
            with pytest.raises(ConnectionError):
                rank.receive()
    finally:
        for rank in ranks:
            rank.close()
        relay.kill()
        relay.wait()
        kernel.server.close()


def test_the_kernel_gone_closes_every_rank_s_link(node):
    kernel, _, ranks = node
    say(ranks[0], 0, Present(0, 0))
    kernel.take(1)
    kernel.server.close()
    for rank in ranks:
        with pytest.raises(ConnectionError):
            rank.receive()


def connect_when_listening(path: Path, key: bytes, timeout: float = 10.0) -> ChannelClient:
    """A rank's connection to the relay, once it listens (as ``attachable`` retries)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ChannelClient(path, key)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def test_a_relay_that_reattaches_serves_the_next_kernel_and_says_nothing_stale(tmp_path):
    """A cluster session's relay outlives its kernel: the ranks' links close with it,
    the relay connects to the next kernel, and the ranks, through it again, speak to
    that one only: neither their last words to the one that went nor the end of their
    old links reach it."""
    folder = Path(os.path.realpath(tmp_path))
    folder.chmod(0o700)
    key = new_key()
    first = Kernel(folder, key)
    (folder / "next").mkdir(mode=0o700)
    second = Kernel(folder / "next", key)
    reattached = []

    def reattach(closed) -> ChannelClient:
        reattached.append(closed())
        return ChannelClient(second.server.address, key)

    relay = node_relay(first.server.address, folder / "relay.sock", key, reattach=reattach)
    ranks = [ChannelClient(folder / "relay.sock", key) for _ in range(2)]
    try:
        for number, rank in enumerate(ranks):
            say(rank, number, Ready(number))
        assert sorted(event.message.rank for event in first.take(2)) == [0, 1]
        first.server.close()
        with contextlib.suppress(OSError):  # (a rank's last word, as its kernel goes)
            say(ranks[0], 0, Present(0, 1), seq=1)
        for rank in ranks:  # the ranks see their kernel gone (and settle)
            with pytest.raises(ConnectionError):
                rank.receive()
            rank.close()
        ranks = [connect_when_listening(folder / "relay.sock", key) for _ in range(2)]
        assert reattached == [False]  # (the relay had not closed)
        for number, rank in enumerate(ranks):
            say(rank, number, Ready(number), seq=5)
        heard = second.take(2)
        assert sorted((event.seq, event.message.rank) for event in heard) == [(5, 0), (5, 1)]
        assert second.server.send_to_each(range(2), RollCall(3)) == set()
        assert [rank.receive() for rank in ranks] == [RollCall(3), RollCall(3)]
        time.sleep(0.2)
        assert second.delivered.empty()  # (no Disconnected of the old links, no copy)
    finally:
        close_all(ranks, relay, first.server, second.server)


def test_what_the_ranks_say_at_once_crosses_in_few_frames_each_rank_s_in_order(node):
    kernel, _, ranks = node
    for seq in range(200):
        for number, rank in enumerate(ranks):
            say(rank, number, Requeueing(number), seq)
    got = kernel.take(800)
    for number in range(4):
        assert [m.seq for m in got if m.rank == number] == list(range(200))
    (relay_link,) = {id(route.link): route.link for route in kernel.server._peers.values()
                     }.values()
    assert relay_link._received < 800  # batched: what waited went in one frame


def test_a_rank_without_the_key_is_refused_by_the_relay(node, tmp_path):
    kernel, relay, _ = node
    with pytest.raises(ConnectionError):
        ChannelClient(Path(os.path.realpath(tmp_path)) / "relay.sock", new_key())
    with socket.socket(socket.AF_UNIX) as stranger:  # and a raw stranger gets nothing
        stranger.connect(str(Path(os.path.realpath(tmp_path)) / "relay.sock"))
        stranger.sendall(os.urandom(64))
    assert kernel.server.send_to_each(range(4), RollCall(9)) == {0, 1, 2, 3}  # (none spoke)
    assert kernel.delivered.empty()  # nothing of the stranger's reached the kernel


def test_the_roll_call_s_answers_and_plain_results_of_a_node_cross_as_one_each(node):
    kernel, _, ranks = node
    for number, rank in enumerate(ranks):
        say(rank, number, Ready(number))
    kernel.take(4)
    assert kernel.server.send_to_each(range(4), RollCall(3)) == set()
    for number, rank in enumerate(ranks):
        assert rank.receive() == RollCall(3)
        say(rank, number, Present(number, 3), 1)
    answered = set()
    while answered != {0, 1, 2, 3}:
        (said,) = kernel.take(1)
        assert isinstance(said, RanksPresent) and said.call == 3
        answered.update(said.ranks)


def stats(rank: int) -> RankStats:
    return RankStats(rank, "node", 100 + rank, 7, 1.0, None, 0)


def test_a_batch_says_once_what_ranks_said_alike_each_rank_s_messages_in_order():
    value = Sequenced(4, Result(0, b"value", stats=stats(0)))
    metrics = [Sequenced(3, Metrics(rank, [(7, {"loss": 1.0})])) for rank in range(4)]
    plain = [Sequenced(4, Result(rank, stats=stats(rank))) for rank in (1, 2, 3)]
    later = Sequenced(5, Ready(2))  # rank 2 speaks again: its result goes before this
    batch = [*metrics, value, plain[0], plain[1], later, plain[2], None]
    assert compact(batch) == [
        NodeMetrics([(7, (0, 1, 2, 3), {"loss": (4.0, 4)})], {}, []), value,
        RanksFinished((1, 2), StatsColumns.of([stats(1), stats(2)])),
        later,
        RanksFinished((3,), StatsColumns.of([stats(3)])),
    ]
    presents = [Sequenced(9, Present(rank, 5)) for rank in range(3)]
    assert compact([*presents, Sequenced(9, Present(3, 6))]) == [
        RanksPresent((0, 1, 2), 5), RanksPresent((3,), 6)]


def test_a_node_s_metrics_are_summed_per_step_and_name_each_rank_s_last_value_counted():
    batches = [
        Metrics(0, [(1, {"loss": 1.0, "acc": 0.5}), (2, {"loss": 0.5})], position=(2, 10, None)),
        Metrics(1, [(1, {"loss": 3.0})], for_all=[(1, {"lr": 0.1})]),
        Metrics(0, [(2, {"loss": 0.25})], position=(3, 10, None)),  # rank 0 again: last wins
    ]
    node = reduced(batches)
    assert node.partials == [(1, (0, 1), {"loss": (4.0, 2), "acc": (0.5, 1)}),
                             (2, (0,), {"loss": (0.25, 1)})]
    assert node.positions == {0: (3, 10, None)}
    assert node.for_all == [(1, [(1, {"lr": 0.1})])]


@pytest.fixture
def cluster_node(tmp_path):
    """A node of a cluster whose kernel is elsewhere: the kernel's server takes data
    files (its inbox), and the node's relay has an inbox for the kernel's and a landing
    for its ranks' (TCP up, as across machines)."""
    from nbddp._rank.relay import Landing
    from nbddp._wire.transfer import place_in

    folder = Path(os.path.realpath(tmp_path))
    folder.chmod(0o700)
    for name in ("kernel-in", "node-in"):
        (folder / name).mkdir(mode=0o700)
    key = new_key()
    delivered: queue.SimpleQueue = queue.SimpleQueue()
    server = ChannelServer(("127.0.0.1", 0), key, delivered.put,
                           inbox=place_in(None, folder / "kernel-in"))
    landing = Landing(None, folder / "landing")
    relay = node_relay(("127.0.0.1", server.port), folder / "relay.sock", key,
                       inbox=place_in(None, folder / "node-in"), landing=landing)
    ranks = [ChannelClient(folder / "relay.sock", key) for _ in range(2)]
    kernel = Kernel.__new__(Kernel)
    kernel.delivered, kernel.server = delivered, server
    try:
        yield kernel, ranks, folder
    finally:
        close_all(ranks, relay, server)


def packed_tensor(nbytes: int):
    import torch

    from nbddp._wire import dataplane

    value = torch.arange(nbytes // 4, dtype=torch.int32)
    return dataplane.pack({"x": value}), value


def test_a_payload_for_a_relayed_rank_lands_on_its_node_and_the_rank_is_told_where(
        cluster_node):
    import torch

    from nbddp._wire import dataplane
    from nbddp._wire.messages import KeepPayload
    from nbddp._wire.transfer import PIECE, Outgoing

    kernel, ranks, folder = cluster_node
    say(ranks[1], 1, Ready(1))
    kernel.take(1)
    packed, value = packed_tensor(PIECE + 4 * 1000)
    assert kernel.server.send(1, KeepPayload(), Outgoing(packed))
    kept = ranks[1].receive()
    assert isinstance(kept, KeepPayload) and Path(kept.file).parent == folder / "node-in"
    assert torch.equal(dataplane.read(Path(kept.file)).load()["x"], value)


def test_a_relayed_rank_s_result_file_reaches_the_kernel_and_leaves_the_node(cluster_node):
    import torch

    from nbddp._wire import dataplane
    from nbddp._wire.messages import PayloadKept
    from nbddp._wire.transfer import Outgoing

    kernel, ranks, folder = cluster_node
    say(ranks[0], 0, Ready(0))
    packed, value = packed_tensor(3 * 2**20)
    ranks[0].send(Sequenced(1, Result(0)), Outgoing(packed))
    say(ranks[0], 0, PayloadKept(0, "/dev/shm/a-node-copy"), seq=2)  # (a name, not a file)
    ready, result, kept = kernel.take(3)
    assert ready == Sequenced(0, Ready(0)) and kept == Sequenced(2, PayloadKept(
        0, "/dev/shm/a-node-copy"))
    assert result.seq == 1 and Path(result.message.file).parent == folder / "kernel-in"
    assert torch.equal(dataplane.read(Path(result.message.file)).load()["x"], value)
    wait_until(lambda: list((folder / "landing").iterdir()) == [],  # (sent on, then removed)
               timeout=10)
    assert kernel.server.send(0, RollCall(1))  # (the rank is still reached by its relay)
    assert ranks[0].receive() == RollCall(1)


def test_nbddp_s_torchrun_options_come_in_any_order_before_torchrun_s():
    """(A Ray agent puts ``--node-data --report FD`` first, and the session adds
    ``--relay`` to torchrun's arguments after them.)"""
    from nbddp._rank.torchrun import _own_options

    options = _own_options(["--node-data", "--report", "7", "--relay", "--nnodes", "2"])
    assert (options.relay, options.node_data, options.report) == (True, True, 7)
    assert options.torchrun == ["--nnodes", "2"]
    plain = _own_options(["--nnodes", "1", "--relay"])  # (torchrun's own from the first)
    assert (plain.relay, plain.node_data, plain.report) == (False, False, None)
    assert plain.torchrun == ["--nnodes", "1", "--relay"]


def test_a_cluster_node_has_a_relay_from_four_ranks():
    from nbddp._run.config import relay_option
    from nbddp._slurm.sbatch import session_torchrun

    assert relay_option(1) == relay_option(3) == [] and relay_option(4) == ["--relay"]
    assert "--relay" not in session_torchrun("/run", "python", 2, 2)
    command = session_torchrun("/run", "python", 2, 4)
    assert command.index("--relay") < command.index("--nnodes")  # (nbddp's, first)
