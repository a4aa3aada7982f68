"""Sessions of 16 ranks on this machine, whose ranks talk to the kernel through their
node's relay (``_rank.relay``): state kept, metrics exact, stacks from every rank, and
a rank that fails, a rank killed and the relay killed each named clearly, nothing left.
The relay is used where the machine has a core for it beside each rank: these tests take
the machine for one that has (a CI machine has two cores), but the last one."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import nbddp
from nbddp._local import cores
from nbddp._local.cores import RELAY_FROM

from .conftest import descendants, wait_until

pytestmark = pytest.mark.slow

RANKS = 16


def relay_socket() -> str | None:
    return os.environ.get("NBDDP_RELAY")


@pytest.fixture(scope="module", autouse=True)
def cores_to_spare():
    """The machine's CPU affinity as on one with a core for the relay beside every rank."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cores, "usable_cores", lambda: 64)
        yield


@pytest.fixture(scope="module")
def session(cores_to_spare):
    os.environ["NBDDP_DISPLAY"] = "text"
    s = nbddp.Session(nprocs=RANKS, output="none")
    try:
        yield s
    finally:
        s.close()
        del os.environ["NBDDP_DISPLAY"]


@pytest.fixture
def own_session(monkeypatch):
    """A session of the test's own (the test ends its ranks)."""
    monkeypatch.setenv("NBDDP_DISPLAY", "text")
    s = nbddp.Session(nprocs=RANKS, output="none")
    try:
        yield s
    finally:
        s.close()


def test_every_rank_speaks_through_its_node_s_relay_and_keeps_its_state(session):
    assert RANKS >= RELAY_FROM  # (what the test is about)
    relays = session.run_all(relay_socket)
    assert len(set(relays)) == 1 and relays[0].endswith("relay.sock")

    def remember() -> None:
        import torch.distributed as dist
        globals()["mine"] = dist.get_rank() * 3

    session.run(remember)
    assert session.run_all(lambda: mine) == [3 * rank for rank in range(RANKS)]  # noqa: F821


def log_steps(steps: int) -> None:
    import torch.distributed as dist

    import nbddp
    for step in range(steps):
        nbddp.log(step=step, loss=dist.get_rank() * 10.0 + step)


def test_the_kernel_s_mean_is_the_mean_over_every_rank_s_values(session):
    job = session.submit(log_steps, (30,))
    job.result(timeout=120)
    rows = job.history
    assert [row["step"] for row in rows] == list(range(30))
    for row in rows:
        assert row["ranks"] == RANKS
        assert row["loss"] == pytest.approx(sum(r * 10.0 + row["step"]
                                                for r in range(RANKS)) / RANKS)


def wait_a_while() -> None:
    import time
    time.sleep(60)


def test_stacks_come_from_every_rank(session):
    job = session.submit(wait_a_while, timeout=120)
    try:
        stacks = wait_until(lambda: (found := job.stacks()) and len(found) == RANKS
                            and all("wait_a_while" in text for text in found.values())
                            and found, timeout=60)
        assert sorted(stacks) == list(range(RANKS))
    finally:
        job.cancel()
    with pytest.raises(Exception, match="cancelled"):
        job.result(timeout=60)


def fail_on(rank: int) -> None:
    import torch.distributed as dist
    if dist.get_rank() == rank:
        raise ValueError(f"bad batch on rank {rank}")


def test_a_failing_rank_is_named_with_its_traceback(session):
    """(The module's session: a cell that fails keeps the ranks and their state.)"""
    pids = session.run_all(os.getpid)
    with pytest.raises(nbddp.WorkerError) as caught:
        session.run(fail_on, 11)
    assert caught.value.rank == 11
    assert "ValueError: bad batch on rank 11" in caught.value.traceback
    assert session.run_all(os.getpid) == pids


def test_a_killed_rank_is_named_and_the_session_says_its_state_is_gone(own_session):
    pids = own_session.run_all(os.getpid)
    job = own_session.submit(wait_a_while, timeout=120)
    time.sleep(1)
    os.kill(pids[5], signal.SIGKILL)
    with pytest.raises(nbddp.WorkerError) as caught:
        job.result(timeout=60)
    assert caught.value.rank == 5 and "SIGKILL" in str(caught.value)
    wait_until(lambda: not set(pids) & descendants(), timeout=30)


def parent_pid() -> int:
    return os.getppid()


def test_the_relay_killed_is_the_node_lost_said_within_seconds(own_session):
    """The relay lives in the node's torchrun process: killing it kills the node."""
    (torchrun,) = set(own_session.run_all(parent_pid))
    job = own_session.submit(wait_a_while, timeout=120)
    time.sleep(1)
    killed = time.monotonic()
    os.kill(torchrun, signal.SIGKILL)
    with pytest.raises(nbddp.NbddpError) as caught:
        job.result(timeout=60)
    assert time.monotonic() - killed < 30
    assert "rank 0 was lost with its node: the relay it spoke through (a node's torchrun " \
        "process) stopped" in str(caught.value)
    wait_until(lambda: torchrun not in descendants(), timeout=30)


def test_an_interrupt_stops_every_rank_and_the_next_cell_works(session):
    job = session.submit(wait_a_while, timeout=120)
    time.sleep(1)
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        job.result(timeout=60)
    assert session.run(lambda: 7) == 7


def test_a_timeout_stops_every_rank_s_cell_and_the_ranks_keep_their_state(session):
    pids = session.run_all(os.getpid)
    job = session.submit(wait_a_while, timeout=3)
    with pytest.raises(TimeoutError, match="back at rest, with their state"):
        job.result(timeout=60)
    assert session.run_all(os.getpid) == pids


def world_sum() -> tuple[int, float]:
    import torch
    import torch.distributed as dist
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return dist.get_world_size(), value.item()


def test_a_launch_of_32_ranks_runs_through_the_relay(monkeypatch):
    monkeypatch.setenv("NBDDP_DISPLAY", "text")
    assert nbddp.launch(world_sum, 32, output="none") == (32, sum(range(32)))


def test_ranks_that_fill_the_machine_s_cores_speak_to_the_kernel_without_a_relay(monkeypatch):
    """There the relay would take CPU from the ranks: every cell would be slower."""
    monkeypatch.setattr(cores, "usable_cores", lambda: RANKS)
    monkeypatch.setenv("NBDDP_DISPLAY", "text")
    s = nbddp.Session(nprocs=RANKS, output="none")
    try:
        assert s.run_all(relay_socket) == [None] * RANKS
        assert s.run(world_sum) == (RANKS, sum(range(RANKS)))
    finally:
        s.close()
