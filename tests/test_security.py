"""Only the user who launched a run can read its payload or talk to its channel."""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import nbddp
from nbddp._run.config import RunConfig
from nbddp._run.groups.payload_place import INLINE_PAYLOAD
from nbddp._slurm.options import SlurmOptions
from nbddp._wire.channel import ChannelClient, ChannelServer
from nbddp._wire.frames import encode
from nbddp._wire.handshake import MAGIC, NONCE_BYTES, new_key
from nbddp._wire.messages import DebugInput, Disconnected, Hello, Ready
from nbddp._wire.sealed_link import MAC_BYTES

from .conftest import SHM, local_run_dirs, wait_until

pytestmark = [pytest.mark.fast, pytest.mark.waits]  # the fast lane: bash scripts/test.sh --fast


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_run_dir_is_private_while_the_run_is_going(tmp_path):
    go = tmp_path / "go"

    def fn(go, _ballast):
        while not os.path.exists(go):
            time.sleep(0.05)

    # (a payload this large goes in a file; a small one travels inside the Start, over
    # the authenticated channel)
    job = nbddp.launch(fn, 2, args=(str(go), b"x" * (INLINE_PAYLOAD + 1)), wait=False,
                       init=False)
    try:
        (run_dir,) = wait_until(local_run_dirs)
        assert mode(run_dir) == 0o700
        twin = Path(SHM, Path(run_dir).name)  # data files in shared memory, where it has room
        if twin.exists():
            assert mode(twin) == 0o700
        payload = wait_until(lambda: [p for p in (twin / "payload.pkl",
                                                  Path(run_dir, "payload.pkl")) if p.exists()])
        assert [mode(p) for p in payload] == [0o600]
        for name in ("key", "channel.sock"):
            wait_until(lambda n=name: os.path.exists(os.path.join(run_dir, n)))
            assert mode(os.path.join(run_dir, name)) == 0o600, name
        records = job.records
        assert mode(records) == 0o700  # the kept logs are private too
        wait_until(lambda: (records / "rank-0.log").exists())
        assert mode(records / "rank-0.log") == 0o600
    finally:
        go.touch()
        job.result(timeout=60)


def test_a_connection_without_the_key_is_refused_and_changes_nothing(tmp_path):
    go = tmp_path / "go"

    def fn(go):
        while not os.path.exists(go):
            time.sleep(0.05)
        return "finished"

    job = nbddp.launch(fn, 2, args=(str(go),), wait=False, init=False)
    (run_dir,) = wait_until(local_run_dirs)
    address = Path(run_dir, "channel.sock")
    wait_until(address.exists)
    try:
        ChannelClient(address, new_key())  # wrong key
    except ConnectionError:
        pass
    else:
        raise AssertionError("a client with the wrong key was accepted")
    go.touch()
    assert job.result(timeout=60) == "finished"


# --- attacks on the channel, through real sockets --------------------------------------
#
# The attacker is anyone who can reach the kernel's socket without the run's key: on a
# cluster, another user on the login node or the network, for the TCP port of a SLURM
# run. What they may try: send the kernel's challenge back to it, replay a handshake and
# frames they recorded, inject or alter frames in a connection that a real rank opened,
# or open a connection and say nothing. Their frames carry a pickle that creates a file
# when it is unpickled: the file must never appear.

HANDSHAKE_FROM_RANK = NONCE_BYTES + MAC_BYTES


class Trap:
    """Unpickling this creates ``path``: the proof that an attacker's bytes ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def trap_frame(path: Path) -> bytes:
    body = pickle.dumps(Trap(path))
    return len(body).to_bytes(8, "big") + body


class Server:
    """A ChannelServer on a Unix socket or on TCP, with every message it delivers."""

    def __init__(self, tmp_path: Path, transport: str) -> None:
        self.key, self.events = new_key(), queue.Queue()
        if transport == "unix":
            self.server = ChannelServer(tmp_path / "s.sock", self.key, self.events.put)
            self.address: Path | tuple[str, int] = tmp_path / "s.sock"
        else:
            self.server = ChannelServer(("127.0.0.1", 0), self.key, self.events.put)
            self.address = ("127.0.0.1", self.server.port)

    def connect(self) -> socket.socket:
        family = socket.AF_UNIX if isinstance(self.address, Path) else socket.AF_INET
        sock = socket.socket(family)
        sock.settimeout(10)
        sock.connect(str(self.address) if isinstance(self.address, Path) else self.address)
        return sock

    def delivered(self, wait: float = 0.5) -> list:
        time.sleep(wait)
        found = []
        while not self.events.empty():
            found.append(self.events.get())
        return found


@pytest.fixture(params=["unix", "tcp"])
def server(request, tmp_path):
    s = Server(tmp_path, request.param)
    try:
        yield s
    finally:
        s.server.close()


def read_available(sock: socket.socket, wait: float = 1.0) -> bytes:
    """What the peer sends within ``wait`` seconds (until it stops or hangs up)."""
    sock.settimeout(wait)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def hung_up(sock: socket.socket) -> bool:
    sock.settimeout(10)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_kernels_challenge_sent_back_to_it_gets_no_answer(server, tmp_path):
    """The reflection attack: the stranger sends the kernel's own challenge back as its
    challenge, hoping the kernel answers it, then returns that answer as its own. The
    kernel must prove nothing before the stranger has, so the trap frame never runs."""
    marker = tmp_path / "pwned"
    with server.connect() as stranger:
        challenge = read_available(stranger)
        assert challenge.startswith(MAGIC)
        stranger.sendall(challenge[len(MAGIC):])  # "our" challenge: the kernel's own
        answer = read_available(stranger)  # a kernel that answers first would say it here
        assert answer == b""
        with_answer = challenge[len(MAGIC):] + answer
        stranger.sendall(with_answer[:HANDSHAKE_FROM_RANK].ljust(HANDSHAKE_FROM_RANK, b"\0"))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            stranger.sendall(trap_frame(marker))
        assert hung_up(stranger)
    assert server.delivered() == []
    assert not marker.exists()


def test_the_kernels_challenge_reflected_through_a_second_connection_gets_no_answer(
        server, tmp_path):
    """The same across two connections: the challenge of one offered on the other."""
    marker = tmp_path / "pwned"
    with server.connect() as first, server.connect() as second:
        challenge = read_available(first)[len(MAGIC):]
        read_available(second)
        second.sendall(challenge + bytes(MAC_BYTES))  # a rank nonce equal to the challenge
        assert read_available(second) == b""  # no proof from the kernel to reuse
        first.sendall(challenge + bytes(MAC_BYTES))
        assert hung_up(first) and hung_up(second)
    assert server.delivered() == []
    assert not marker.exists()


class Relay:
    """A man in the middle between a rank and the kernel, on TCP: it forwards both
    ways, records what the rank sends, and lets the test alter or inject bytes."""

    def __init__(self, target: tuple[str, int] | Path,
                 to_kernel: Callable[[bytes, int], bytes] = lambda data, offset: data,
                 to_rank: Callable[[bytes, int], bytes] = lambda data, offset: data) -> None:
        self.target, self.recorded = target, b""
        self._tamper = {"to_kernel": to_kernel, "to_rank": to_rank}
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = ("127.0.0.1", self.listener.getsockname()[1])
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            rank, _ = self.listener.accept()
        except OSError:
            return
        family = socket.AF_UNIX if isinstance(self.target, Path) else socket.AF_INET
        kernel = socket.socket(family)
        kernel.connect(str(self.target) if isinstance(self.target, Path) else self.target)
        self._sockets += [rank, kernel]
        for source, sink, way in ((rank, kernel, "to_kernel"), (kernel, rank, "to_rank")):
            thread = threading.Thread(target=self._pump, args=(source, sink, way), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _pump(self, source: socket.socket, sink: socket.socket, way: str) -> None:
        offset = 0
        try:
            while chunk := source.recv(1):  # byte by byte: offsets are exact
                if way == "to_kernel":
                    self.recorded += chunk
                sink.sendall(self._tamper[way](chunk, offset))
                offset += 1
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=10)
        for sock in self._sockets:
            sock.close()


def framed_size(message) -> int:
    return len(encode(message)) + MAC_BYTES


def test_a_recorded_handshake_and_its_frames_replayed_are_refused(server):
    """The stranger recorded a real rank's connection (handshake and frames) and plays
    it back on a new connection of its own: the kernel's fresh nonce makes it worthless."""
    relay = Relay(server.address)
    try:
        client = ChannelClient(relay.address, server.key)
        client.send(Hello(rank=0, pid=1))
        assert server.events.get(timeout=10) == Hello(rank=0, pid=1)
        client.close()
        assert server.events.get(timeout=10) == Disconnected(0)
    finally:
        relay.close()
    assert len(relay.recorded) == HANDSHAKE_FROM_RANK + framed_size(Hello(rank=0, pid=1))
    with server.connect() as stranger:
        read_available(stranger, wait=0.2)
        stranger.sendall(relay.recorded)
        assert hung_up(stranger)
    assert server.delivered() == []


def test_a_wrong_key_is_refused_and_says_nothing_more(server):
    with pytest.raises(ConnectionError, match="key"):
        ChannelClient(server.address, new_key())
    assert server.delivered() == []
    with server.connect() as stranger:  # by hand: after a wrong proof the kernel hangs up
        challenge = read_available(stranger, wait=0.2)
        stranger.sendall(os.urandom(HANDSHAKE_FROM_RANK))
        assert read_available(stranger) == b""
        assert len(challenge) == len(MAGIC) + NONCE_BYTES
    assert server.delivered() == []


def test_a_frame_altered_on_the_way_to_the_kernel_closes_the_connection(server):
    """A byte of the rank's second frame (its rank number inside the pickle) is changed
    on the way: the kernel must not deliver it, nor anything after it."""
    first, second = Hello(rank=0, pid=1), Ready(rank=0)
    at = HANDSHAKE_FROM_RANK + framed_size(first) + len(encode(second)) - 3

    def flip(data: bytes, offset: int) -> bytes:
        return bytes([data[0] ^ 0x01]) if offset == at else data

    relay = Relay(server.address, to_kernel=flip)
    try:
        client = ChannelClient(relay.address, server.key)
        client.send(first)
        client.send(second)
        assert server.events.get(timeout=10) == first
        assert server.events.get(timeout=10) == Disconnected(0)
        client.close()
    finally:
        relay.close()
    assert server.delivered() == []


def test_a_frame_injected_towards_the_kernel_is_never_unpickled(server, tmp_path):
    """After a real rank's good handshake and first frame, the stranger slips in a frame
    of its own (with a made-up tag): the connection closes before it is unpickled."""
    marker = tmp_path / "pwned"
    at = HANDSHAKE_FROM_RANK + framed_size(Hello(rank=0, pid=1))
    injected = trap_frame(marker) + os.urandom(MAC_BYTES)

    def inject(data: bytes, offset: int) -> bytes:
        return injected + data if offset == at else data

    relay = Relay(server.address, to_kernel=inject)
    try:
        client = ChannelClient(relay.address, server.key)
        client.send(Hello(rank=0, pid=1))
        client.send(Ready(rank=0))
        assert server.events.get(timeout=10) == Hello(rank=0, pid=1)
        assert server.events.get(timeout=10) == Disconnected(0)
        client.close()
    finally:
        relay.close()
    assert server.delivered() == []
    assert not marker.exists()


def test_a_frame_injected_towards_a_rank_is_never_unpickled(server, tmp_path):
    """The other way: a forged frame for the rank (a Start, say) before the kernel's
    real one. The rank's link breaks; nothing of the stranger's runs there."""
    marker = tmp_path / "pwned"
    injected = trap_frame(marker) + os.urandom(MAC_BYTES)
    at = len(MAGIC) + NONCE_BYTES + MAC_BYTES  # right after the kernel's proof

    def inject(data: bytes, offset: int) -> bytes:
        return injected + data if offset == at else data

    relay = Relay(server.address, to_rank=inject)
    try:
        client = ChannelClient(relay.address, server.key)
        client.send(Hello(rank=0, pid=1))
        assert server.events.get(timeout=10) == Hello(rank=0, pid=1)
        assert server.server.send(0, DebugInput(0, "c"))
        with pytest.raises(ConnectionError, match="authentication"):
            client.receive()
        client.close()
    finally:
        relay.close()
    assert not marker.exists()


def test_a_rank_refuses_a_kernel_that_does_not_hold_the_key(tmp_path):
    """A stranger listening where a rank connects (a port it grabbed first) learns one
    proof bound to its own nonce, and gets no message from the rank."""
    received = []
    with socket.create_server(("127.0.0.1", 0)) as fake:

        def impostor() -> None:
            conn, _ = fake.accept()
            with conn:
                conn.sendall(MAGIC + os.urandom(NONCE_BYTES))
                received.append(read_available(conn, wait=0.5))
                conn.sendall(os.urandom(MAC_BYTES))
                received.append(read_available(conn, wait=1.0))

        thread = threading.Thread(target=impostor)
        thread.start()
        with pytest.raises(ConnectionError, match="does not hold the run's key"):
            ChannelClient(("127.0.0.1", fake.getsockname()[1]), new_key())
        thread.join(timeout=10)
    assert [len(r) for r in received] == [HANDSHAKE_FROM_RANK, 0]


def test_a_stranger_that_says_nothing_holds_up_no_rank(server):
    with server.connect() as silent:
        read_available(silent, wait=0.2)
        client = ChannelClient(server.address, server.key)  # while the stranger waits
        client.send(Hello(rank=0, pid=1))
        assert server.events.get(timeout=5) == Hello(rank=0, pid=1)
        client.close()
    assert server.events.get(timeout=10) == Disconnected(0)


def test_a_slurm_runs_channel_listens_only_where_its_ranks_are_told(monkeypatch):
    """Not on every interface: on a login node, a port bound to all addresses is open
    to every network the node is on. The run's address file names where it listens."""
    from nbddp._slurm.group import SlurmGroup

    monkeypatch.setenv("NBDDP_KERNEL_HOST", "127.0.0.1")
    group = SlurmGroup.for_submission(RunConfig(nprocs=1), SlurmOptions())
    try:
        host, port = group.run_dir.address.read_text().split()
        assert host == "127.0.0.1"
        with socket.create_connection((host, int(port)), timeout=10) as told:
            assert read_available(told, wait=0.5).startswith(MAGIC)
        with pytest.raises(ConnectionRefusedError):  # another address of this machine
            socket.create_connection(("127.0.0.2", int(port)), timeout=10).close()
    finally:
        group.stop()
        group.close()


def test_a_kernel_whose_name_does_not_resolve_opens_no_port(monkeypatch):
    """Rather than every interface: no channel at all, and the ranks report through
    their files (as when they cannot reach the kernel)."""
    from nbddp._slurm.group import SlurmGroup

    monkeypatch.setenv("NBDDP_KERNEL_HOST", "unreachable.invalid")
    group = SlurmGroup.for_submission(RunConfig(nprocs=1), SlurmOptions())
    try:
        assert group.run_dir.key.exists()
        assert not group.run_dir.address.exists()
    finally:
        group.stop()
        group.close()


@pytest.mark.parametrize("loosened", ["folder others can write to", "key others can read",
                                      "key a symlink"])
def test_a_ray_session_folder_someone_else_could_have_made_is_not_attached(
        tmp_path, monkeypatch, loosened):
    """A Ray session is attached from its folder in the user's records (its key, its
    record): a folder another user made or can write to, or a key not the user's alone,
    could hold a key of theirs, which would let them in. Such a folder is not offered."""
    from nbddp._ray.options import Ray
    from nbddp._ray.session import RAY_SESSION, RaySessionRecord, kept_ray_sessions
    from nbddp._run.records import Records
    from nbddp._wire.rundir import RunDir

    monkeypatch.setenv("NBDDP_RUNS_DIR", str(tmp_path / "runs"))
    run_dir = RunDir.of_job(Records.create().path)
    run_dir.write_private(run_dir.key, b"k" * 32)
    run_dir.write_private(run_dir.path / RAY_SESSION, RaySessionRecord(
        "ray-0123abcd", Ray(), 2, None, True, None, "rank0", started=0.0,
        placement_group="00" * 18).to_json())
    assert [record.session_id for record, _ in kept_ray_sessions()] == ["ray-0123abcd"]
    if loosened == "folder others can write to":
        run_dir.path.chmod(0o777)
    elif loosened == "key others can read":
        run_dir.key.chmod(0o644)
    else:
        (tmp_path / "theirs").write_bytes(b"t" * 32)
        run_dir.key.unlink()
        run_dir.key.symlink_to(tmp_path / "theirs")
    assert kept_ray_sessions() == []
