"""Data files across machines (``_wire.transfer``): a payload or a result crosses the
channel into a private file on the other side, hashed once, trusted only once the sealed
digests match. Real channels on TCP; the attacker is a relay on the way."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from pathlib import Path

import pytest
import torch

from nbddp._wire import dataplane
from nbddp._wire.channel import ChannelClient
from nbddp._wire.frames import encode
from nbddp._wire.handshake import MAGIC, NONCE_BYTES
from nbddp._wire.messages import Disconnected, Hello, KeepPayload, Result, Sequenced
from nbddp._wire.sealed_link import MAC_BYTES
from nbddp._wire.transfer import PIECE, Outgoing, place_in

from .test_security import Relay, Server, hung_up, read_available

pytestmark = pytest.mark.fast


@pytest.fixture
def tcp_server(tmp_path):
    server = Server(tmp_path, "tcp")
    try:
        yield server
    finally:
        server.server.close()


def packed_tensor(nbytes: int) -> tuple[dataplane.Packed, torch.Tensor]:
    value = torch.arange(nbytes // 4, dtype=torch.int32)
    return dataplane.pack({"x": value, "note": "hello"}), value


def test_a_file_lands_whole_and_private_and_maps_like_a_local_one(tcp_server, tmp_path):
    """More than one piece, a buffer that does not end on a piece's edge: the rank's
    file holds what the kernel sent, 0600, and maps to equal tensors."""
    inbox = tmp_path / "node"
    inbox.mkdir(mode=0o700)
    client = ChannelClient(tcp_server.address, tcp_server.key, place_in(None, inbox))
    try:
        client.send(Hello(0, 1))
        assert tcp_server.events.get(timeout=10) == Hello(0, 1)
        packed, value = packed_tensor(2 * PIECE + 12_345 * 4)
        sending = threading.Thread(target=tcp_server.server.send,  # as the kernel does: the
                                   args=(0, KeepPayload(), Outgoing(packed)))  # rank reads
        sending.start()
        kept = client.receive()
        sending.join()
        assert isinstance(kept, KeepPayload) and kept.file.startswith(str(inbox) + "/")
        assert stat.S_IMODE(os.stat(kept.file).st_mode) == 0o600
        loaded = dataplane.read(Path(kept.file)).load()
        assert loaded["note"] == "hello" and torch.equal(loaded["x"], value)
    finally:
        client.close()


def test_a_result_from_a_rank_lands_in_the_kernels_inbox(tmp_path):
    """The other way, wrapped as a rank's reports are (``Sequenced``): the kernel's
    ``Result`` names the file it landed in."""
    inbox = tmp_path / "kernel"
    inbox.mkdir(mode=0o700)
    server = Server(tmp_path, "tcp")
    server.server._inbox = place_in(None, inbox)
    client = ChannelClient(server.address, server.key)
    try:
        packed, value = packed_tensor(PIECE // 2)
        client.send(Sequenced(0, Result(0)), Outgoing(packed))
        got = server.events.get(timeout=10)
        assert got.message.rank == 0 and got.message.file.startswith(str(inbox) + "/")
        assert torch.equal(dataplane.read(Path(got.message.file)).load()["x"], value)
    finally:
        client.close()
        server.server.close()


def test_a_byte_of_a_file_altered_on_the_way_leaves_no_file_and_closes_the_link(
        tcp_server, tmp_path):
    """The attacker changes one byte of the tensor's bytes (raw, outside any frame): the
    rank's link refuses the file before anything reads it, removes it, and closes."""
    inbox = tmp_path / "node"
    inbox.mkdir(mode=0o700)
    packed, _ = packed_tensor(256 * 1024)
    outgoing = Outgoing(packed)
    announce = outgoing.announce(KeepPayload())
    proof = len(MAGIC) + NONCE_BYTES + MAC_BYTES  # the kernel's handshake, then its frame
    tensor_offset = len(encode(announce)) + MAC_BYTES + outgoing.pieces[0][1].nbytes + 100

    def flip(data: bytes, offset: int) -> bytes:
        return bytes([data[0] ^ 0x40]) if offset == proof + tensor_offset else data

    relay = Relay(tcp_server.address, to_rank=flip)
    try:
        client = ChannelClient(relay.address, tcp_server.key, place_in(None, inbox))
        client.send(Hello(0, 1))
        assert tcp_server.events.get(timeout=10) == Hello(0, 1)
        assert tcp_server.server.send(0, KeepPayload(), outgoing)
        with pytest.raises(ConnectionError, match="authentication"):
            client.receive()
        assert list(inbox.iterdir()) == []
        client.close()
    finally:
        relay.close()


def test_a_file_sent_to_a_link_that_takes_none_closes_it(tcp_server):
    """A kernel's channel without an inbox (a local run) takes no data file: a rank that
    sends one (or a stranger with the key's help) is cut off, and nothing is delivered."""
    client = ChannelClient(tcp_server.address, tcp_server.key)
    try:
        client.send(Hello(0, 1))
        assert tcp_server.events.get(timeout=10) == Hello(0, 1)
        packed, _ = packed_tensor(4 * 2**20)
        with contextlib.suppress(OSError):  # (the kernel hangs up while it goes)
            client.send(Sequenced(0, Result(0)), Outgoing(packed))
        assert tcp_server.events.get(timeout=10) == Disconnected(0)
        assert tcp_server.delivered() == []
    finally:
        client.close()


def test_a_stranger_cannot_announce_a_file_without_the_key(tcp_server, tmp_path):
    """Raw bytes before any handshake: nothing is written anywhere, the kernel hangs up."""
    with tcp_server.connect() as stranger:
        read_available(stranger, wait=0.2)
        stranger.sendall(os.urandom(4096))
        assert hung_up(stranger)
    assert tcp_server.delivered() == []


def test_a_node_without_room_drops_the_file_and_the_link_goes_on(tcp_server, tmp_path):
    """The inbox cannot take the file (here: its folder is gone; in life, a full disk):
    the bytes are read and dropped, the message says so (``file == ""``), and the next
    message on the link arrives as usual."""
    client = ChannelClient(tcp_server.address, tcp_server.key,
                           place_in(None, tmp_path / "gone"))
    try:
        client.send(Hello(0, 1))
        assert tcp_server.events.get(timeout=10) == Hello(0, 1)
        packed, _ = packed_tensor(PIECE + 4096)
        sending = threading.Thread(target=tcp_server.server.send,
                                   args=(0, KeepPayload(), Outgoing(packed)))
        sending.start()
        assert client.receive() == KeepPayload("")
        sending.join()
        assert tcp_server.server.send(0, KeepPayload("after"))
        assert client.receive() == KeepPayload("after")
        assert not (tmp_path / "gone").exists()
    finally:
        client.close()
