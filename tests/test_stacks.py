"""Where every rank is: stacks taken from live ranks, on demand and before a timeout or
an interrupt stops them.

Real launches: the stuck run (rank 1 in a helper, rank 0 waiting in ``dist.barrier()``)
ends by timeout with both places named; ``Job.stacks()`` while a run goes on; an
interrupt carries the stacks too. Unit tests of the rendering first.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

import nbddp
from nbddp._wire.stacks import read_dump, render, where

from .conftest import wait_until

DUMP = """Thread 0x00007f00000000aa (most recent call first):
  File "/lib/threading.py", line 320 in wait

Current thread 0x00007f00000000bb (most recent call first):
  File "/work/train.py", line 7 in helper
  File "/work/train.py", line 12 in train
"""


def test_the_main_thread_comes_first_and_is_named():
    shown = render(DUMP, "0x00007f00000000bb")
    assert shown.startswith('Main thread (most recent call first):\n  File "/work/train.py"')
    assert shown.index("helper") < shown.index("threading.py")
    assert where({1: shown}).splitlines()[1:4] == [
        "--- rank 1 ---", "Main thread (most recent call first):",
        '  File "/work/train.py", line 7 in helper']


def test_a_rank_that_does_not_answer_gives_nothing(tmp_path):
    assert read_dump(tmp_path / "stacks-0.txt", 0, wait=0.2) is None


# --- live ranks -----------------------------------------------------------------------


def stuck_in_helper(seconds):
    import time

    time.sleep(seconds)


def stuck_run(started=None):
    import pathlib

    import torch.distributed as dist

    if started:
        pathlib.Path(started, f"rank-{dist.get_rank()}").touch()
    if dist.get_rank() == 1:
        stuck_in_helper(600)
    dist.barrier()


def test_a_timeout_says_where_each_rank_was():
    job = nbddp.launch(stuck_run, 2, timeout=10, wait=False)
    with pytest.raises(TimeoutError) as caught:
        job.result()
    error = caught.value
    assert "in stuck_in_helper" in error.stacks[1] and "in barrier" in error.stacks[0]
    text = str(error)
    assert "did not finish within 10 s" in text and "where each rank was" in text
    assert text.index("--- rank 0 ---") < text.index("in barrier") < text.index(
        "--- rank 1 ---") < text.index("in stuck_in_helper")
    kept = (job.records / "stacks.txt").read_text()
    assert "in stuck_in_helper" in kept and "in barrier" in kept


def test_stacks_are_taken_while_the_run_goes_on(tmp_path):
    job = nbddp.launch(stuck_run, 2, args=(str(tmp_path),), wait=False, timeout=120)
    try:
        wait_until(lambda: len(list(tmp_path.glob("rank-*"))) == 2, timeout=60)
        stacks = job.stacks()
        assert set(stacks) == {0, 1}
        assert stacks[1].startswith("Main thread") and "in stuck_in_helper" in stacks[1]
        assert not job.done()  # taking them stopped nothing
    finally:
        job.cancel()
    assert job.stacks() == {}  # the ranks are gone


def test_an_interrupt_carries_the_stacks(tmp_path):
    def interrupt_when_started():
        wait_until(lambda: len(list(tmp_path.glob("rank-*"))) == 2, timeout=60)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_started, daemon=True).start()
    with pytest.raises(KeyboardInterrupt) as caught:
        nbddp.launch(stuck_run, 2, args=(str(tmp_path),))
    assert "in stuck_in_helper" in caught.value.stacks[1]


STUCK_CELL = """def helper():
    import time
    time.sleep(600)

def stuck():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        helper()
    dist.barrier()

nbddp.launch(stuck, nprocs=2, timeout=10)
"""


def test_in_a_kernel_the_timeout_names_rank_1s_helper_and_rank_0s_barrier_line(kernel):
    kernel.run("import nbddp").assert_ok()
    run = kernel.run(STUCK_CELL, timeout=90)
    assert run.error() is not None and run.error()["ename"] == "TimeoutError", run.describe()
    text = run.error_text()
    rank_0, rank_1 = text.split("--- rank 0 ---")[1].split("--- rank 1 ---")
    assert "in barrier" in rank_0 and re.search(r"Cell In\[\d+\], line 9 in stuck", rank_0)
    assert re.search(r"Cell In\[\d+\], line 3 in helper", rank_1), rank_1
