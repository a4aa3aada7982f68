"""Every way a run can go wrong: a clear exception, and nothing left behind.

The autouse ``no_leftovers`` fixture checks each test for processes, run dirs and
sockets left behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import nbddp


def raise_on_rank_one_while_rank_zero_waits():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(0.5)  # rank 0 is blocked in the collective by now
        raise ValueError("bad batch on rank 1")
    t = torch.ones(1)
    dist.all_reduce(t)  # never completes: rank 1 is gone


@pytest.mark.fast
def test_a_raising_rank_is_the_root_cause_and_its_peers_are_torn_down():
    start = time.monotonic()
    with pytest.raises(nbddp.WorkerError) as info:
        nbddp.launch(raise_on_rank_one_while_rank_zero_waits, 2)
    error = info.value
    assert error.rank == 1
    assert 'raise ValueError("bad batch on rank 1")' in error.traceback
    assert "raise_on_rank_one_while_rank_zero_waits" in error.traceback
    assert "_worker.py" not in error.traceback  # starts in the user's code
    assert isinstance(error.__cause__, ValueError)
    assert str(error.__cause__) == "bad batch on rank 1"
    assert "rank 1 raised ValueError: bad batch on rank 1" in str(error)
    assert time.monotonic() - start < 30  # not gloo's 30-minute collective timeout
    states = {rank: info["state"] for rank, info in nbddp.last_job().ranks.items()}
    assert states == {0: "stopped", 1: "failed"}  # rank 0 only lost its peer


def test_a_notebook_exception_class_comes_back_as_the_cause():
    class DataError(Exception):
        pass

    def fn():
        raise DataError("shard 3 is empty")

    with pytest.raises(nbddp.WorkerError) as info:
        nbddp.launch(fn, 2)
    assert type(info.value.__cause__).__name__ == "DataError"


def test_ipython_renders_the_remote_traceback_labelled_by_rank():
    def fn():
        import torch.distributed as dist

        if dist.get_rank() == 0:
            raise KeyError("missing")

    with pytest.raises(nbddp.WorkerError) as info:
        nbddp.launch(fn, 2)
    rendered = "\n".join(info.value._render_traceback_())
    assert "traceback from rank 0" in rendered
    assert 'raise KeyError("missing")' in rendered


def test_a_rank_that_exits_without_raising_is_named_with_its_exit_code_and_output():
    def fn():
        import torch.distributed as dist

        print(f"rank {dist.get_rank()} loading shard", flush=True)
        if dist.get_rank() == 1:
            os._exit(3)
        time.sleep(60)

    with pytest.raises(nbddp.WorkerError) as info:
        nbddp.launch(fn, 2)
    error = info.value
    assert (error.rank, error.exitcode, error.signal) == (1, 3, None)
    assert error.traceback is None
    assert "rank 1 loading shard" in error.output_tail
    assert "exited with code 3" in str(error)
    assert "rank 1 loading shard" in str(error)


@pytest.mark.parametrize("how, signame", [("kill", "SIGKILL"), ("segfault", "SIGSEGV")])
def test_a_rank_killed_by_a_signal_is_named_with_the_signal(how, signame):
    def fn(how):
        import ctypes

        import torch.distributed as dist

        if dist.get_rank() == 1:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            ctypes.string_at(0)
        time.sleep(60)

    with pytest.raises(nbddp.WorkerError) as info:
        nbddp.launch(fn, 2, args=(how,))
    assert (info.value.rank, info.value.signal) == (1, signame)
    if how == "segfault":  # faulthandler leaves the Python stack in the rank's log
        assert "Segmentation fault" in info.value.logs[1]
        assert "in fn" in info.value.logs[1]


def test_a_return_value_that_cannot_be_pickled_is_a_clear_error():
    def fn():
        return threading.Lock()

    with pytest.raises(nbddp.WorkerError) as info:
        nbddp.launch(fn, 2)
    assert info.value.rank == 0
    assert "return value cannot be sent back" in str(info.value)


@pytest.mark.fast
def test_timeout_stops_every_rank():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 2 s"):
        nbddp.launch(time.sleep, 2, args=(120,), timeout=2)
    assert time.monotonic() - start < 30
    assert [info["state"] for info in nbddp.last_job().ranks.values()] == ["stopped"] * 2


@pytest.mark.fast
def test_a_timeout_while_the_ranks_start_says_they_were_starting():
    """Not that they did not answer: nothing is stuck, the ranks were slow to start (a
    cluster's nodes, a large import)."""
    with pytest.raises(TimeoutError) as info:
        nbddp.launch(time.sleep, 2, args=(120,), timeout=0.5)
    report = str(info.value)
    assert "rank 0: still starting (it had not said hello to the kernel yet)" in report
    assert "did not answer" not in report


def test_keyboard_interrupt_stops_every_rank_then_raises(tmp_path):
    started = tmp_path / "started"

    def fn(started):
        open(started, "w").close()
        time.sleep(120)

    def interrupt_once_running():
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_running, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        nbddp.launch(fn, 2, args=(str(started),))
    # the autouse fixture checks that nothing is left; and the next launch works
    assert nbddp.launch(len, 2, args=("ab",), init=False) == 2


def test_a_session_run_no_thread_could_take_over_ends_clearly_and_ctrl_c_works_again(
        monkeypatch):
    """A run the caller follows for its first moments, then hands to a follower thread:
    if no thread can start (a process out of threads), the run ends in the caller with
    nbddp's error, its ranks stopped, Ctrl-C raises again, and the session goes on with
    fresh ranks."""
    from nbddp._run import job

    with nbddp.Session(nprocs=2, output="none") as session:
        session.run(len, "ab")

        def no_thread(task):
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(job, "follow", no_thread)
        with pytest.raises(nbddp.NbddpError, match="can't start new thread"):
            session.run(time.sleep, 30)
        monkeypatch.undo()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert session.run(len, "abc") == 3


def test_gloo_aborting_at_exit_after_a_clean_run_is_not_a_failure():
    def fn():
        import atexit

        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        atexit.register(os.abort)  # what gloo's "terminate called..." looks like
        return t.item()

    assert nbddp.launch(fn, 2) == 2.0


def test_sys_exit_zero_counts_as_returning_none():
    import sys

    assert nbddp.launch(sys.exit, 2, args=(0,), init=False) is None


def test_a_rank_that_dies_is_the_root_cause_not_the_peer_that_lost_it():
    def fn():
        import torch.distributed as dist

        if dist.get_rank() == 1:
            time.sleep(0.5)  # rank 0 is waiting in the barrier by now
            os._exit(3)
        dist.barrier()  # fails with "Connection closed by peer" once rank 1 is gone

    for _ in range(3):  # the race between the two reports must always end the same way
        with pytest.raises(nbddp.WorkerError) as info:
            nbddp.launch(fn, 2)
        assert (info.value.rank, info.value.exitcode) == (1, 3), str(info.value)


def test_ranks_with_another_nbddp_version_say_so(monkeypatch):
    """The notebook's nbddp and the ranks' must match (on a cluster they are installed
    apart): a mismatch is named, not an unpickling error."""
    import nbddp._version

    installed = nbddp.__version__  # what the ranks import from disk
    monkeypatch.setattr(nbddp._version, "__version__", "0.0.0-notebook")
    with pytest.raises(nbddp.WorkerError, match="install the same nbddp") as caught:
        nbddp.launch(print, nprocs=2)
    assert f"this rank runs nbddp {installed}" in str(caught.value)
    assert "with nbddp 0.0.0-notebook" in str(caught.value)
