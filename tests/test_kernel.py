"""nbddp driven from a real Jupyter kernel, checking what a notebook user would see.

Each test sends cells to an ipykernel (``jupyter_client``) and looks at the messages
the notebook front end would render for that cell: stream output, results, errors.
Tests that kill or interrupt the kernel get a kernel of their own; the others share
one per module.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from .conftest import descendants, run_dirs, wait_until
from .kernel_driver import CELL_TIMEOUT, Execution, Kernel

pytestmark = pytest.mark.waits  # the waiting lane (tests/conftest.py)


def _start_time(pid: int) -> str | None:
    """Start time of a live, non-zombie process (None when there is none)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def _alive(processes: dict[int, str]) -> list[int]:
    descendants()  # reaps the zombies adopted by pytest (a child subreaper)
    return [pid for pid, start in processes.items() if _start_time(pid) == start]


def _snapshot(pids) -> dict[int, str]:
    return {pid: start for pid in pids if (start := _start_time(pid)) is not None}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"


SLEEPER = """
def sleeper():
    import time
    import torch.distributed as dist
    print(f"rank {dist.get_rank()} is sleeping", flush=True)
    time.sleep(300)

nbddp.launch(sleeper, nprocs=2)
"""


def interrupt_and_check(kernel: Kernel, run: Execution, procs: dict[int, str]) -> None:
    """Interrupt the kernel: the cell ends in KeyboardInterrupt and every process is gone."""
    interrupted = time.monotonic()
    kernel.km.interrupt_kernel()
    run.finish(timeout=30)
    assert run.error() is not None and run.error()["ename"] == "KeyboardInterrupt", \
        run.describe()
    assert run.idle_at - interrupted < 10, "the interrupted cell took too long to return"
    try:
        wait_until(lambda: not _alive(procs) and not descendants(kernel.pid), timeout=5)
    except AssertionError:
        left = set(_alive(procs)) | descendants(kernel.pid)
        raise AssertionError("still running after the interrupt: "
                             + "; ".join(_cmdline(p) for p in left)) from None


def _wait_for_ranks(kernel: Kernel, run: Execution) -> tuple[dict[int, str], str]:
    """Once rank 0 runs the user's code: the kernel's descendants (torchrun and the
    ranks) with their start times, and the run directory."""
    run.wait_for_output("rank 0 is sleeping")
    procs = wait_until(lambda: (d if len(d := descendants(kernel.pid)) >= 3 else None),
                       timeout=CELL_TIMEOUT)
    commands = [_cmdline(p).split() for p in procs]
    launchers = [c for c in commands if "nbddp._torchrun" in c]
    ranks = [c for c in commands if "nbddp._worker" in c and c not in launchers]
    assert len(launchers) == 1 and len(ranks) == 2, commands
    run_dir = launchers[0][launchers[0].index("nbddp._torchrun") + 1]
    assert run_dir in run_dirs(), (run_dir, run_dirs())
    return _snapshot(procs), run_dir


# --- tests ----------------------------------------------------------------------------


def test_function_using_notebook_definitions(kernel):
    """A helper, a class, a closure and a lambda defined in cells all reach the ranks."""
    kernel.run("""
        def helper(x):
            return 3 * x

        class Accumulator:
            def __init__(self, start):
                self.total = start

            def add(self, value):
                self.total += value
                return self

        def make_scale(k):
            def scale(v):
                return k * v
            return scale

        scale = make_scale(5)
        square = lambda v: v ** 2
    """).assert_ok()
    run = kernel.run("""
        def work(offset):
            import torch
            import torch.distributed as dist

            rank, world = dist.get_rank(), dist.get_world_size()
            mine = torch.tensor([float(square(scale(helper(rank + offset))))])
            dist.all_reduce(mine)
            return Accumulator(world).add(int(mine.item()))

        out = nbddp.launch(work, nprocs=2, args=(4,))
        isinstance(out, Accumulator), out.total
    """).assert_ok()
    expected = 2 + sum((5 * 3 * (rank + 4)) ** 2 for rank in range(2))
    assert run.result() == f"(True, {expected})", run.describe()


def test_a_method_named_like_an_unpicklable_notebook_global_leaves_it_behind(kernel, tmp_path):
    """``model.train()`` reads the attribute ``train``, not the notebook's ``train``: the
    launch works, a pickling error names what really cannot be sent, export leaves it out."""
    kernel.run("""
        import threading

        train = threading.Lock()  # a notebook global that shares a method's name
        writer = threading.Lock()

        class Model:
            def train(self):
                self.mode = "training"
                return self

        def fit():
            return Model().train().mode

        def fit_and_log():
            Model().train()
            with writer:
                pass
    """).assert_ok()
    try:
        run = kernel.run("nbddp.launch(fit, nprocs=2)").assert_ok()
        assert run.result() == "'training'", run.describe()
        failed = kernel.run("nbddp.launch(fit_and_log, nprocs=2)")
        assert (failed.error() or {}).get("ename") == "PayloadError", failed.describe()
        text = failed.error_text()
        assert "cannot send global 'writer' (used by fit_and_log)" in text, text
        assert "global 'train'" not in text, text
        path = tmp_path / "fit.py"
        written = kernel.run(f"[p.name for p in nbddp.export(fit, {str(path)!r})]")
        assert written.assert_ok().result() == "['fit.py', 'fit.sbatch']", written.describe()
    finally:
        kernel.run("del train, writer").assert_ok()


def test_rank0_output_appears_live_in_the_launching_cell(kernel):
    run = kernel.run("""
        import sys

        def chatty():
            import time
            import torch.distributed as dist
            rank = dist.get_rank()
            print(f"stdout line from rank {rank}", flush=True)
            print(f"stderr line from rank {rank}", file=sys.stderr, flush=True)
            if rank == 0:
                time.sleep(3)  # the line above must be on screen before the cell ends
            dist.barrier()
            return "done"

        nbddp.launch(chatty, nprocs=2)
    """).assert_ok()
    assert run.result() == "'done'"
    text = run.stream_text()
    assert "stdout line from rank 0" in text, run.describe()
    # Rank 0's log holds stdout and stderr in the order written; both reach the
    # notebook on its stdout stream.
    assert "stderr line from rank 0" in text, run.describe()
    assert "rank 1" not in text, run.describe()  # only rank 0 is forwarded
    first = next(o for o in run.outputs
                 if o.msg_type == "stream" and "stdout line from rank 0" in o.content["text"])
    assert first.arrived < run.idle_at - 1.5, "rank 0's output was not forwarded live"
    # The next cell gets none of it.
    after = kernel.run("print('next cell')").assert_ok()
    assert after.stream_text() == "next cell\n", after.describe()


def test_background_job_output_stays_under_the_cell_that_launched_it(kernel):
    launching = kernel.run("""
        def slow_talker():
            import time
            import torch.distributed as dist
            time.sleep(2)  # the next cell is running by now
            print(f"background rank {dist.get_rank()} speaking", flush=True)
            return "quiet now"

        job = nbddp.launch(slow_talker, nprocs=2, wait=False)
    """).assert_ok()
    other = kernel.run("import time; time.sleep(8); print('other cell')").assert_ok()
    assert "background rank 0" not in other.stream_text(), other.describe()
    waiting = kernel.run("job.result()").assert_ok()
    assert waiting.result() == "'quiet now'"
    assert "background rank 0" not in waiting.stream_text(), waiting.describe()
    assert "background rank 0 speaking" in launching.stream_text(), launching.describe()


def test_failing_rank_shows_remote_traceback_and_kernel_recovers(kernel):
    run = kernel.run("""
        def fails_on_rank_1():
            import time
            import torch
            import torch.distributed as dist
            if dist.get_rank() == 1:
                time.sleep(1)  # so that rank 0 is surely blocked in the all_reduce
                raise ValueError("rank one is unhappy")
            print("rank 0 waits for rank 1", flush=True)
            t = torch.ones(1)
            dist.all_reduce(t)
            return t.item()

        nbddp.launch(fails_on_rank_1, nprocs=2)
    """)
    error = run.error()
    assert error is not None, run.describe()
    assert error["ename"] == "WorkerError", run.describe()
    text = run.error_text()
    assert "rank 1" in text, text
    assert 'raise ValueError("rank one is unhappy")' in text, text  # the cell's source line
    assert "in fails_on_rank_1" in text, text
    assert "ValueError: rank one is unhappy" in text, text
    assert "nbddp/_worker.py" not in text, text  # the traceback starts in user code
    assert "rank 0 waits for rank 1" in run.stream_text(), run.describe()

    again = kernel.run("nbddp.launch(lambda: 6 * 7, nprocs=2)").assert_ok()
    assert again.result() == "42"


def test_interrupt_stops_every_process_and_kernel_stays_usable(fresh_kernel):
    fresh_kernel.run("import nbddp").assert_ok()
    run = fresh_kernel.submit(SLEEPER)
    procs, _ = _wait_for_ranks(fresh_kernel, run)

    interrupt_and_check(fresh_kernel, run, procs)

    again = fresh_kernel.run("nbddp.launch(lambda: 'still here', nprocs=2)").assert_ok()
    assert again.result() == "'still here'"


def test_kernel_death_stops_torchrun_and_ranks(fresh_kernel):
    fresh_kernel.run("import nbddp").assert_ok()
    run = fresh_kernel.submit(SLEEPER)
    procs, run_dir = _wait_for_ranks(fresh_kernel, run)

    os.kill(fresh_kernel.pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
        wait_until(lambda: not _alive(procs), timeout=10)
    except AssertionError:
        raise AssertionError("still running 10 s after the kernel died: "
                             + "; ".join(_cmdline(p) for p in _alive(procs))) from None
    try:
        wait_until(lambda: not os.path.exists(run_dir),
                   timeout=max(0.1, killed + 10 - time.monotonic()))
    except AssertionError:
        shutil.rmtree(run_dir)  # so the leftover check reports only this failure
        raise AssertionError("the run directory outlived the killed kernel") from None


def test_kernel_that_imported_torch_can_launch(fresh_kernel):
    fresh_kernel.run("""
        import torch
        import nbddp

        weights = torch.arange(4, dtype=torch.float32)
        weights.sum().item()
    """).assert_ok()
    run = fresh_kernel.run("""
        def weighted(w):
            import torch.distributed as dist
            out = w * (dist.get_rank() + 1)
            dist.all_reduce(out)
            return out

        total = nbddp.launch(weighted, nprocs=2, args=(weights,))
        total.tolist()
    """).assert_ok()
    assert run.result() == "[0.0, 3.0, 6.0, 9.0]"


KILLED_AS_IT_STARTS = """
import nbddp
nbddp.standby(False)
print("ready", flush=True)
nbddp.launch(print, nprocs=2)
"""


def test_a_kernel_killed_as_it_makes_a_run_dir_leaves_nothing(tmp_path):
    """Killed the moment a group's run dir appears (before, the kernel made the dir, then
    started torchrun, whose lifeline removes it when the kernel dies: a kernel killed
    between left it), the kernel leaves no folder and no process behind."""
    temp = Path(tempfile.mkdtemp(prefix="nbk-", dir="/tmp"))  # (short: the socket's path)
    shm = tmp_path / "shm"
    env = {**os.environ, "TMPDIR": str(temp)}
    if os.path.isdir("/dev/shm"):
        shm = Path(tempfile.mkdtemp(prefix="pytest-nbddp-killed-", dir="/dev/shm"))
        env["NBDDP_SHM_DIR"] = str(shm)
    made = [temp / "nbddp-*", shm / "nbddp-*"]
    before = descendants()
    kernel = subprocess.Popen([sys.executable, "-c", KILLED_AS_IT_STARTS], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert kernel.stdout is not None and kernel.stdout.readline() == "ready\n"
        while not glob.glob(str(made[0])):
            assert kernel.poll() is None, "the launch ended before its run dir was seen"
            time.sleep(0.0002)
        kernel.kill()
        kernel.wait()
        wait_until(lambda: not (descendants() - before), timeout=15)
        wait_until(lambda: not any(glob.glob(str(pattern)) for pattern in made), timeout=15)
    finally:
        kernel.kill()
        kernel.wait()
        for folder in (temp, shm):
            shutil.rmtree(folder, ignore_errors=True)
