"""Only the user who launched a run can read its payload or talk to its channel."""

from __future__ import annotations

import os
import queue
import socket
import stat
import time
from pathlib import Path

import pytest

import nbddp
from nbddp._channel import KEY_BYTES, ChannelClient, ChannelServer, new_key
from nbddp._messages import HEADER_SIZE, Hello

from .conftest import SHM, local_run_dirs, wait_until


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_run_dir_is_private_while_the_run_is_going(tmp_path):
    go = tmp_path / "go"

    def fn(go):
        while not os.path.exists(go):
            time.sleep(0.05)

    job = nbddp.launch(fn, 2, args=(str(go),), wait=False, init=False)
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


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_server_sends_nothing_but_a_challenge_to_a_stranger(tmp_path, transport):
    """The Unix socket of a local run, and the TCP port a SLURM job's ranks connect to
    (open to the network, so the key is all that keeps strangers out)."""
    events: queue.Queue = queue.Queue()
    key = new_key()
    server = ChannelServer(tmp_path / "s.sock" if transport == "unix" else ("", 0), key,
                           events.put)
    address = tmp_path / "s.sock" if transport == "unix" else ("127.0.0.1", server.port)
    try:
        with socket.socket(socket.AF_UNIX if transport == "unix" else socket.AF_INET) \
                as stranger:
            stranger.connect(str(address) if transport == "unix" else address)
            challenge = stranger.recv(1024)
            assert len(challenge) == KEY_BYTES
            stranger.sendall(os.urandom(KEY_BYTES))  # our challenge to it
            stranger.sendall(os.urandom(KEY_BYTES))  # a wrong answer to its challenge
            stranger.settimeout(10)
            try:  # a frame, if the server has not hung up already
                stranger.sendall((5).to_bytes(HEADER_SIZE, "big") + b"hello")
                while stranger.recv(1024):  # the server drops the connection
                    pass
            except (BrokenPipeError, ConnectionResetError):
                pass  # it hung up first: just as well
        client = ChannelClient(address, key)  # the right key still works
        client.send(Hello(rank=0, pid=1))
        assert events.get(timeout=10) == Hello(rank=0, pid=1)
        assert events.empty()  # the stranger's bytes never became an event
        client.close()
    finally:
        server.close()
    assert not (tmp_path / "s.sock").exists()
