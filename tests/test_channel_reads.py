"""The kernel's one thread that reads every rank connection (``_wire.read_loop.ReadLoop``),
over real sockets with the run's key: every connection's messages arrive whole and in
order, and one connection's trouble (a message the kernel cannot take, a frame cut into
pieces, the channel closed from inside a delivery) leaves every other one heard."""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

import pytest

from nbddp._wire import sealed_link
from nbddp._wire.channel import ChannelClient, ChannelServer
from nbddp._wire.handshake import new_key
from nbddp._wire.messages import Disconnected, Ready, Sequenced

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


@pytest.fixture
def folder(tmp_path):
    path = Path(os.path.realpath(tmp_path))
    path.chmod(0o700)
    return path


def take(delivered: queue.SimpleQueue, count: int, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    return [delivered.get(timeout=max(0.01, deadline - time.monotonic()))
            for _ in range(count)]


def reading_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("nbddp-channel")]


def test_many_connections_each_heard_whole_and_in_order_by_one_thread(folder):
    key, delivered = new_key(), queue.SimpleQueue()
    server = ChannelServer(folder / "c.sock", key, delivered.put)
    ranks = [ChannelClient(folder / "c.sock", key) for _ in range(64)]
    try:
        for seq in range(30):
            for number, rank in enumerate(ranks):
                rank.send(Sequenced(seq, Ready(number)))
        got = take(delivered, 64 * 30)
        for number in range(64):
            assert [m.seq for m in got if m.message.rank == number] == list(range(30))
        # one reader for them all (the accept thread and the reader), not one each
        assert reading_threads().count("nbddp-channel-reads") == 1
        assert reading_threads().count("nbddp-channel-reader") == 0
    finally:
        for rank in ranks:
            rank.close()
        server.close()
    assert "nbddp-channel-reads" not in reading_threads()


def trickle(sock, data) -> None:
    """Send a byte at a time, a little apart."""
    for i in range(len(data)):
        sock.sendall(bytes(data[i:i + 1]))
        time.sleep(0.0005)


def test_frames_that_arrive_in_pieces_are_each_taken_once_whole(folder, monkeypatch):
    key, delivered = new_key(), queue.SimpleQueue()
    server = ChannelServer(folder / "c.sock", key, delivered.put)
    rank = ChannelClient(folder / "c.sock", key)
    try:
        monkeypatch.setattr(sealed_link, "_send_all", trickle)  # (every link's frames)
        rank.send(Ready(3))
        rank.send(Sequenced(1, Ready(3)))
        assert take(delivered, 2) == [Ready(3), Sequenced(1, Ready(3))]
    finally:
        rank.close()
        server.close()


def test_a_message_the_kernel_cannot_take_ends_that_connection_only(folder):
    key, delivered = new_key(), queue.SimpleQueue()

    def deliver(message):
        if getattr(message, "rank", None) == 0 and isinstance(message, Ready):
            raise RuntimeError("the kernel cannot take this")
        delivered.put(message)

    server = ChannelServer(folder / "c.sock", key, deliver)
    bad, good = (ChannelClient(folder / "c.sock", key) for _ in range(2))
    try:
        bad.send(Ready(0))
        assert take(delivered, 1) == [Disconnected(0)]  # named, not silent
        with pytest.raises(ConnectionError):
            bad.receive()  # the kernel hung up on it
        good.send(Ready(1))
        assert take(delivered, 1) == [Ready(1)]
        assert server.send(1, Ready(1))
    finally:
        bad.close()
        good.close()
        server.close()


def test_a_delivery_that_closes_the_channel_closes_it_without_waiting_on_itself(folder):
    key, delivered = new_key(), queue.SimpleQueue()
    server: ChannelServer

    def deliver(message):
        delivered.put(message)
        if isinstance(message, Ready):
            server.close()  # (e.g. a group stopped from its own callback)

    server = ChannelServer(folder / "c.sock", key, deliver)
    ranks = [ChannelClient(folder / "c.sock", key) for _ in range(3)]
    try:
        started = time.monotonic()
        ranks[0].send(Ready(0))
        got = take(delivered, 1)
        for rank in ranks:
            with pytest.raises(ConnectionError):
                rank.receive()
        assert got == [Ready(0)] and time.monotonic() - started < 4  # (no 5 s join)
        deadline = time.monotonic() + 5
        while "nbddp-channel-reads" in reading_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "nbddp-channel-reads" not in reading_threads()
        assert not (folder / "c.sock").exists()
    finally:
        for rank in ranks:
            rank.close()


def test_a_rank_is_quiet_until_its_link_brings_a_message_and_again_after(folder):
    """(What lets a cluster session's next cell skip its roll call: every rank's link
    was heard in the last second.)"""
    key, delivered = new_key(), queue.SimpleQueue()
    server = ChannelServer(folder / "c.sock", key, delivered.put)
    ranks = [ChannelClient(folder / "c.sock", key) for _ in range(2)]
    try:
        ranks[0].send(Ready(0))
        ranks[1].send(Ready(1))
        take(delivered, 2)
        middle = time.monotonic()
        assert server.quiet([0, 1, 7], since=middle - 5) == {7}  # (7 never connected)
        ranks[1].send(Sequenced(1, Ready(1)))
        take(delivered, 1)
        assert server.quiet([0, 1], since=middle) == {0}
        ranks[1].close()
        assert take(delivered, 1) == [Disconnected(1)]
        assert server.quiet([0, 1], since=middle - 5) == {1}  # gone: not connected
    finally:
        for rank in ranks:
            rank.close()
        server.close()
