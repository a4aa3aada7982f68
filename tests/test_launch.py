"""nbddp.launch from plain Python: real torchrun process groups, gloo on CPU."""

from __future__ import annotations

import os
import threading
import time

import pytest

import nbddp

from .conftest import wait_until


def all_reduce_rank(offset=0):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


@pytest.mark.fast
def test_rank_zero_result_comes_back():
    assert nbddp.launch(all_reduce_rank, 2, args=(10,)) == (0, 2, 21.0)


def test_all_ranks_in_rank_order_with_kwargs():
    results = nbddp.launch(all_reduce_rank, 3, kwargs={"offset": 1}, all_ranks=True)
    assert results == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_closures_lambdas_and_local_classes_ship_by_value():
    class Scale:
        def __init__(self, k):
            self.k = k

        def __call__(self, x):
            return self.k * x

    scale = Scale(3)
    square = lambda x: x * x  # noqa: E731

    def train():
        import torch.distributed as dist

        return square(scale(dist.get_world_size()))

    assert nbddp.launch(train, 2) == 36


def test_init_false_leaves_the_process_group_to_the_user():
    def fn():
        import torch
        import torch.distributed as dist

        assert not dist.is_initialized()
        dist.init_process_group("gloo")  # torchrun's environment is standard
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.item(), os.environ["WORLD_SIZE"]

    assert nbddp.launch(fn, 2, init=False) == (2.0, "2")


def test_default_process_group_is_gloo_on_cpu_and_threads_stay_at_one():
    def fn():
        import torch
        import torch.distributed as dist

        return dist.get_backend(), torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")

    assert nbddp.launch(fn, 2) == ("gloo", 1, "1")


@pytest.mark.fast
def test_rank_zero_output_is_streamed_live(capfd, tmp_path):
    go = tmp_path / "go"

    def fn(go):
        import torch.distributed as dist

        print(f"hello from rank {dist.get_rank()}", flush=True)
        while not os.path.exists(go):  # keep running until the test saw the line
            time.sleep(0.05)
        return "done"

    job = nbddp.launch(fn, 2, args=(str(go),), wait=False)
    seen = []
    wait_until(lambda: seen.append(capfd.readouterr().out) or "hello from rank 0" in "".join(seen))
    assert not job.done()
    go.touch()
    assert job.result(timeout=60) == "done"
    out = "".join(seen) + capfd.readouterr().out
    assert "hello from rank 1" not in out  # only rank 0 is shown; the rest is in job.logs
    assert "hello from rank 1" in job.logs[1]


def test_job_handle_result_done_and_cancel(tmp_path):
    job = nbddp.launch(time.sleep, 2, args=(60,), wait=False)
    assert not job.done()
    assert job.cancel() is True
    assert job.done()
    from concurrent.futures import CancelledError

    with pytest.raises(CancelledError):
        job.result()
    assert job.cancel() is False


def test_next_launch_works_after_a_failure():
    def fail():
        raise RuntimeError("first run fails")

    with pytest.raises(nbddp.WorkerError):
        nbddp.launch(fail, 2)
    assert nbddp.launch(all_reduce_rank, 2) == (0, 2, 1.0)


def test_two_concurrent_launches_do_not_collide():
    results = {}

    def run(offset):
        results[offset] = nbddp.launch(all_reduce_rank, 2, args=(offset,))

    threads = [threading.Thread(target=run, args=(k,)) for k in (100, 200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == {100: (0, 2, 201.0), 200: (0, 2, 401.0)}


def test_module_functions_are_imported_by_name():
    import statistics

    assert nbddp.launch(statistics.mean, 2, args=([1, 2, 3],), init=False) == 2


def test_two_processes_launching_at_once_do_not_collide(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "kernel.py"
    script.write_text(
        "import sys, nbddp\n"
        "def fn(k):\n"
        "    import torch, torch.distributed as dist\n"
        "    t = torch.tensor([k]); dist.all_reduce(t); return t.item()\n"
        "print('result', nbddp.launch(fn, 2, args=(int(sys.argv[1]),)))\n"
    )
    procs = [subprocess.Popen([sys.executable, str(script), str(k)], stdout=subprocess.PIPE,
                              text=True) for k in (3, 5)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert "result 6" in outputs[0] and "result 10" in outputs[1]


def say_hello_twice():
    import sys

    import torch.distributed as dist

    rank = dist.get_rank()
    print(f"hello from {rank}", flush=True)
    sys.stdout.write(f"partial line from {rank}")  # no newline: still shown, still prefixed
    sys.stdout.flush()


def test_output_all_prefixes_every_rank_and_none_shows_nothing(capfd):
    nbddp.launch(say_hello_twice, 2, output="all")
    lines = capfd.readouterr().out.splitlines()
    for rank in (0, 1):
        assert f"[rank {rank}] hello from {rank}" in lines
        assert f"[rank {rank}] partial line from {rank}" in lines
    nbddp.launch(say_hello_twice, 2, output="none")
    assert "hello" not in capfd.readouterr().out


def test_bad_output_choice_is_rejected():
    with pytest.raises(ValueError, match="output must be one of"):
        nbddp.launch(print, 2, output="rank1")


def test_modules_on_the_kernels_sys_path_import_on_the_ranks(tmp_path, monkeypatch):
    import importlib
    import sys

    (tmp_path / "helpers_on_path.py").write_text("def triple(x):\n    return 3 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # what sys.path.append does in a notebook
    monkeypatch.chdir("/")  # not found through the working directory either
    module = importlib.import_module("helpers_on_path")
    try:
        assert nbddp.launch(module.triple, 2, args=(5,), init=False) == 15
    finally:
        del sys.modules["helpers_on_path"]
