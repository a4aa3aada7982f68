"""``%%ddp`` driven from a real Jupyter kernel, checking what a notebook user would see.

Most tests share one kernel (the ``ddp`` fixture: the ``kernel`` of conftest with the
extension loaded and a probe that counts the processes the kernel starts, so that "no
process started" is checked, not assumed). The interrupt test has a kernel of its own.
Line numbers in tracebacks count the ``%%ddp`` line as line 1, as the notebook shows it.
"""

from __future__ import annotations

import re
import time

import pytest

from .conftest import descendants, run_dirs, wait_until
from .kernel_driver import Execution, Kernel
from .test_kernel import _wait_for_ranks, interrupt_and_check

OPTIONS = ("--gpus", "--nprocs", "--backend", "--timeout", "--no-init", "--out", "--all-ranks",
           "--slurm", "--nodes", "--time", "--partition", "--cpus-per-task", "--sbatch",
           "--export", "--requeue", "--signal-before", "--stall-after")

# Installed in the shared kernel: every subprocess.Popen the kernel creates (torchrun
# is started that way) is counted, so a test can say that an error came before any
# process existed, however short-lived that process would have been.
POPEN_PROBE = """
import subprocess as _probe_subprocess

_probe_popens = []
_probe_popen_init = _probe_subprocess.Popen.__init__


def _probe_counting_init(self, *args, **kwargs):
    _probe_popens.append(args[0] if args else kwargs.get("args"))
    _probe_popen_init(self, *args, **kwargs)


_probe_subprocess.Popen.__init__ = _probe_counting_init
"""


@pytest.fixture(scope="module")
def ddp(kernel):
    """The module's kernel with ``%load_ext nbddp`` run and the process probe installed."""
    kernel.run("%load_ext nbddp").assert_ok()
    kernel.run(POPEN_PROBE).assert_ok()
    return kernel


def _popens(kernel: Kernel) -> int:
    """How many processes the kernel has started with subprocess.Popen so far."""
    run = kernel.run("len(_probe_popens)").assert_ok()
    return int(run.result())


def _reply(kernel: Kernel, run: Execution, timeout: float = 10.0) -> dict:
    """The execute_reply of a finished cell (earlier cells' replies are skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = kernel.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") == run.msg_id:
            return msg["content"]


def _ok_result(kernel: Kernel, code: str) -> str:
    run = kernel.run(code).assert_ok()
    result = run.result()
    assert result is not None, run.describe()
    return result


def _assert_nothing_started(kernel: Kernel, before: int, run: Execution) -> None:
    started = _popens(kernel) - before
    assert started == 0, f"{started} process(es) started despite the error:\n{run.describe()}"
    assert not descendants(kernel.pid), run.describe()


# --- help and options -----------------------------------------------------------------


@pytest.mark.fast
def test_help_lists_every_option(ddp):
    before = _popens(ddp)
    run = ddp.run("""
        %%ddp -h
        raise RuntimeError("the body of a help request must not run")
    """).assert_ok()
    text = run.stream_text()
    for option in OPTIONS:
        assert option in text, f"{option} missing from the help:\n{text}"
    assert "--nprocs N" in text and "--timeout SECONDS" in text, text
    _assert_nothing_started(ddp, before, run)

    # %%ddp? shows the same, in the pager (the reply's payload, not the cell's output)
    asked = ddp.run("%%ddp?").assert_ok()
    pages = [p["data"]["text/plain"] for p in _reply(ddp, asked).get("payload", [])
             if p.get("source") == "page"]
    assert pages, "%%ddp? showed nothing"
    for option in OPTIONS:
        assert option in pages[0], f"{option} missing from %%ddp?:\n{pages[0]}"


CHATTY = """
import torch.distributed as dist
print(f"hello from rank {dist.get_rank()}", flush=True)
dist.get_world_size(), dist.get_backend(), dist.get_rank()
"""


@pytest.mark.fast
def test_nprocs_runs_a_gloo_group_and_shows_the_trailing_expression(ddp):
    run = ddp.run("%%ddp --nprocs 2" + CHATTY).assert_ok()
    assert run.result() == "(2, 'gloo', 0)", run.describe()
    assert [o.msg_type for o in run.outputs].count("execute_result") == 1, run.describe()
    text = run.stream_text()
    assert "hello from rank 0" in text, run.describe()
    assert "hello from rank 1" not in text, run.describe()  # rank 0's output only ...
    assert not re.search(r"^\[rank \d+\] ", text, re.M), run.describe()  # ... unprefixed


def test_all_ranks_prefixes_every_ranks_lines_and_backend_is_honoured(ddp):
    run = ddp.run("%%ddp --nprocs 2 --all-ranks --backend gloo" + CHATTY).assert_ok()
    assert run.result() == "(2, 'gloo', 0)", run.describe()  # still rank 0's value
    lines = run.stream_text("stdout").splitlines()
    assert "[rank 0] hello from rank 0" in lines, run.describe()
    assert "[rank 1] hello from rank 1" in lines, run.describe()
    hello = [line for line in lines if "hello from rank" in line]
    assert len(hello) == 2 and all(re.match(r"\[rank [01]\] ", line) for line in hello), \
        run.describe()


def test_no_init_leaves_the_process_group_to_the_cell(ddp):
    result = _ok_result(ddp, """
        %%ddp --nprocs 2 --no-init
        import os
        import torch.distributed as dist
        dist.is_initialized(), os.environ["RANK"], os.environ["WORLD_SIZE"]
    """)
    assert result == "(False, '0', '2')"


def test_timeout_stops_every_rank(ddp):
    dirs = run_dirs()
    started = time.monotonic()
    run = ddp.run("""
        %%ddp --nprocs 2 --timeout 2
        import time
        time.sleep(600)
    """)
    elapsed = time.monotonic() - started
    assert run.error() is not None and run.error()["ename"] == "TimeoutError", run.describe()
    assert "did not finish within 2 s" in run.error_text(), run.describe()
    # (not the sleep's end: the ranks were stopped; the bound is loose for a loaded machine)
    assert elapsed < 120, f"the cell returned {elapsed:.1f} s after it started"
    wait_until(lambda: not descendants(ddp.pid) and run_dirs() == dirs, timeout=30)
    assert _ok_result(ddp, "%%ddp --nprocs 2\n'after the timeout'") == "'after the timeout'"


def test_a_timeouts_report_is_shown_once_and_its_ranks_as_stopped(ddp):
    """The whole report (where each rank was, its stacks) is in the error IPython shows,
    once; the streamed summary and the panel say one line; the ranks nbddp stopped are
    ``stopped``, not ``failed``."""
    run = ddp.run("""
        %%ddp --nprocs 2 --timeout 8
        import time
        time.sleep(120)
    """)
    assert run.error() is not None and run.error()["ename"] == "TimeoutError", run.describe()
    error = run.error_text()
    assert "where each rank was:" in error and "--- rank 1 ---" in error, error
    everything = run.shown_text() + error
    assert everything.count("where each rank was:") == 1, everything
    assert everything.count("--- rank 0 ---") == 1, everything
    summary = [line for line in run.stream_text().splitlines() if line.startswith("nbddp: ")]
    assert len(summary) == 1 and "did not finish within 8 s" in summary[0], run.describe()
    panel = [o.content["data"]["text/plain"] for o in run.outputs
             if o.msg_type in ("display_data", "update_display_data")
             and "nbddp: timed out" in o.content.get("data", {}).get("text/plain", "")]
    assert panel, run.describe()
    header = panel[-1].splitlines()[0]
    assert "(ranks: 0 stopped, 1 stopped)" in header, header
    assert "failed" not in header and "did not finish within 8 s" in header, header


def _summary_lines(run: Execution) -> list[str]:
    """nbddp's own lines in the cell's streamed output (its one-line summary)."""
    return [line for line in run.stream_text().splitlines() if line.startswith("nbddp: ")]


def _last_panel_header(run: Execution, status: str) -> str:
    """The first line of the panel's last state that says ``status``."""
    panel = [o.content["data"]["text/plain"] for o in run.outputs
             if o.msg_type in ("display_data", "update_display_data")
             and status in o.content.get("data", {}).get("text/plain", "")]
    assert panel, run.describe()
    return panel[-1].splitlines()[0]


def test_a_failures_traceback_is_shown_once_and_the_rank_it_stopped_as_stopped(ddp):
    """A rank's traceback is in the error IPython shows, once (the one-line summaries
    name the error); the streamed summary is one line; the rank nbddp stopped because
    of it is ``stopped``, the one that raised ``failed``."""
    run = ddp.run("""
        %%ddp --nprocs 2
        import time
        import torch.distributed as dist
        if dist.get_rank() == 1:
            raise ValueError("shard 17 is empty")
        time.sleep(120)
    """)
    assert run.error() is not None, run.describe()
    error = run.error_text()
    assert "ValueError: shard 17 is empty" in error, error
    everything = run.shown_text() + error
    assert everything.count("Traceback (most recent call last)") == 1, everything
    assert everything.count('raise ValueError("shard 17 is empty")') == 1, everything
    assert len(_summary_lines(run)) == 1, run.describe()
    header = _last_panel_header(run, "nbddp: failed")
    assert "0 stopped" in header and "1 failed" in header, header


def test_more_gpus_than_visible_is_a_usage_error_naming_nprocs(ddp):
    ddp.run("""
        import os as _probe_os
        _probe_cvd = _probe_os.environ.get("CUDA_VISIBLE_DEVICES")
        _probe_os.environ["CUDA_VISIBLE_DEVICES"] = ""   # no GPU, whatever the machine has
    """).assert_ok()
    try:
        before = _popens(ddp)
        for gpus in ("2", "0,1"):
            run = ddp.run(f"%%ddp --gpus {gpus}\nprint('ran')").assert_ok()
            err = run.stream_text("stderr")
            assert "UsageError" in err and "--gpus" in err, run.describe()
            assert "--nprocs" in err, run.describe()
            assert "ran" not in run.stream_text("stdout"), run.describe()
        bad = ddp.run("%%ddp --gpus two\nprint('ran')").assert_ok()
        assert "UsageError" in bad.stream_text("stderr"), bad.describe()
        assert "'two'" in bad.stream_text("stderr"), bad.describe()
        _assert_nothing_started(ddp, before, run)
    finally:
        ddp.run("""
            if _probe_cvd is None:
                del _probe_os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                _probe_os.environ["CUDA_VISIBLE_DEVICES"] = _probe_cvd
        """).assert_ok()


# --- names going in and coming back ---------------------------------------------------


def test_out_brings_back_a_trained_model_as_its_module(ddp):
    ddp.run("""
        import torch
        from torch.nn.parallel import DistributedDataParallel

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = torch.nn.Sequential(
                    torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

            def forward(self, x):
                return self.layers(x)
    """).assert_ok()
    run = ddp.run("""
        %%ddp --nprocs 2 --out model,weights_on_rank0,initial
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        model = DDP(Net())
        initial = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(dist.get_rank())  # each rank its own data
        for step in range(5):
            x = torch.randn(16, 4, generator=g)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        # every rank computes its own; rank 0's is the one that comes back
        weights_on_rank0 = (dist.get_rank(),
                            {k: v.detach().clone() for k, v in model.module.state_dict().items()})
        print("trained", flush=True)
    """).assert_ok()
    assert "trained" in run.stream_text(), run.describe()
    assert run.result() is None, run.describe()  # a trailing print() shows no result
    result = _ok_result(ddp, """
        rank, expected = weights_on_rank0
        state = model.state_dict()
        (
            rank,
            type(model) is Net,                                  # the notebook's own class
            isinstance(model, DistributedDataParallel),
            sorted(state) == sorted(expected),
            all(torch.equal(state[k], expected[k]) for k in state),  # exactly equal
            all(v.device.type == "cpu" for v in state.values()),
            all(v.device.type == "cpu" for v in expected.values()),
            any(not torch.equal(state[k], initial[k]) for k in state),  # it did train
            model(torch.ones(3, 4)).shape,                           # usable right here
        )
    """)
    assert result == "(0, True, False, True, True, True, True, True, torch.Size([3, 1]))"


def test_notebook_function_class_and_lambda_share_the_cells_globals(ddp):
    ddp.run("""
        import math as m

        SCALE = 10
        OFFSET = -1000  # the cell assigns its own OFFSET; that is the one scaled() sees

        def scaled(x):
            return x * SCALE + OFFSET

        def describe():
            return f"label={LABEL}"  # LABEL exists only in the cell

        class Counter:
            def __init__(self, start):
                self.n = start

            def bump(self):
                self.n += 1
                return self

        square = lambda v: v * v  # noqa: E731
    """).assert_ok()
    result = _ok_result(ddp, """
        %%ddp --nprocs 2 --out counter
        import torch
        import torch.distributed as dist

        OFFSET = 1
        LABEL = "from the cell"
        total = torch.tensor([float(square(dist.get_rank() + 2))])
        dist.all_reduce(total)                     # 2*2 + 3*3
        counter = Counter(int(total.item())).bump()
        scaled(2), describe(), counter.n, round(m.pi, 2)
    """)
    assert result == "(21, 'label=from the cell', 14, 3.14)"
    assert _ok_result(ddp, "type(counter) is Counter, counter.n") == "(True, 14)"
    # Only names the cell read were involved; the notebook's own values are unchanged.
    assert _ok_result(ddp, "OFFSET, 'LABEL' in globals()") == "(-1000, False)"


def test_notebook_class_method_sees_a_global_the_cell_assigns(ddp):
    ddp.run("""
        MODE = "notebook"

        class Reader:
            def get(self):
                return MODE
    """).assert_ok()
    assert _ok_result(ddp, "%%ddp --nprocs 2\nMODE = 'cell'\nReader().get()") == "'cell'"


def test_bad_out_name_is_a_usage_error(ddp):
    before = _popens(ddp)
    run = ddp.run("%%ddp --nprocs 2 --out model,1x\nmodel = 1").assert_ok()
    err = run.stream_text("stderr")
    assert "UsageError" in err and "--out" in err and "1x" in err, run.describe()
    _assert_nothing_started(ddp, before, run)


def test_the_line_form_shows_help_or_says_it_is_a_cell_magic(ddp):
    text = ddp.run("%ddp -h").assert_ok().stream_text()
    assert all(option in text for option in OPTIONS), text
    run = ddp.run("%ddp --nprocs 2").assert_ok()
    assert "is a cell magic" in run.stream_text("stderr"), run.describe()


@pytest.mark.parametrize("options, message", [
    ("--nprocs 0", "nprocs must be at least 1"),
    ("--nprocs 2 --timeout -1", "timeout must be a positive"),
    ("--gpus ,", "gpus must be a positive count"),
    ("--nodes 2", "add --slurm or --ray to run the cell on one, or --export PATH"),
    ("--time 01:00:00", "add --slurm to submit the cell, or --export PATH"),
    ("--slurm --export job.py", "choose one"),
    ("--nprocs 2 --stall-after -1", "stall_after must be a positive number"),
    ("--requeue", "add --slurm"),
    ("--export job.py --signal-before 60", "add --slurm"),
    ("--slurm --signal-before 0", "signal_before=...) is a number of seconds"),
])
@pytest.mark.fast
def test_bad_option_values_are_usage_errors(ddp, options, message):
    before = _popens(ddp)
    run = ddp.run(f"%%ddp {options}\nx = 1").assert_ok()
    err = run.stream_text("stderr")
    assert "UsageError" in err and message in err, run.describe()
    _assert_nothing_started(ddp, before, run)


def test_out_name_the_cell_never_defines_is_named(ddp):
    run = ddp.run("%%ddp --nprocs 2 --out defined,never_defined\ndefined = 1")
    error = run.error()
    assert error is not None, run.describe()
    text = run.error_text()
    assert "--out" in text and re.search(r"\bnever_defined\b", text), text
    assert _ok_result(ddp, "'never_defined' in globals()") == "False"


def test_out_name_defined_on_rank0_only(ddp):
    ddp.run("""
        %%ddp --nprocs 2 --out summary
        import torch.distributed as dist
        if dist.get_rank() == 0:
            summary = "from rank 0"
    """).assert_ok()
    assert _ok_result(ddp, "summary") == "'from rank 0'"


def test_cell_that_exits_cleanly_ends_without_error(ddp):
    run = ddp.run("%%ddp --nprocs 2 --out before\nimport sys\nbefore = 1\nsys.exit(0)\nafter = 2")
    run.assert_ok()
    assert _ok_result(ddp, "before, 'after' in globals()") == "(1, False)"


def test_a_trailing_semicolon_hides_the_result(ddp):
    run = ddp.run("%%ddp --nprocs 2\nx = 5\nx;").assert_ok()
    assert run.result() is None, run.describe()


# --- errors ---------------------------------------------------------------------------


@pytest.mark.fast
def test_syntax_error_points_at_the_cells_line_before_anything_starts(ddp):
    before = _popens(ddp)
    run = ddp.run("""
        %%ddp --nprocs 2
        x = 1
        for i in range(3)
            x += i
    """)
    error = run.error()
    assert error is not None and error["ename"] == "SyntaxError", run.describe()
    count = _reply(ddp, run)["execution_count"]
    text = run.error_text()
    assert f"Cell In[{count}], line 3" in text, text  # line 1 is the %%ddp line
    assert "for i in range(3)" in text, text
    _assert_nothing_started(ddp, before, run)


@pytest.mark.fast
def test_unpicklable_name_is_a_payload_error_naming_it(ddp):
    ddp.run("import threading\nlock = threading.Lock()").assert_ok()
    before = _popens(ddp)
    run = ddp.run("%%ddp --nprocs 2\nwith lock:\n    pass")
    error = run.error()
    assert error is not None and error["ename"] == "PayloadError", run.describe()
    assert "'lock'" in run.error_text() and "pickle" in run.error_text(), run.describe()
    _assert_nothing_started(ddp, before, run)
    ddp.run("del lock").assert_ok()


def test_augmented_assignment_reads_the_notebooks_value(ddp):
    ddp.run("total = 41").assert_ok()
    assert _ok_result(ddp, "%%ddp --nprocs 2 --out total\ntotal += 1\ntotal") == "42"
    assert _ok_result(ddp, "total") == "42"


def test_a_comprehension_variable_is_not_the_notebooks(ddp):
    """The notebook's ``z`` cannot be pickled; the cell's ``z`` is the comprehension's."""
    ddp.run("import threading\nz = threading.Lock()\nxs = [1, 2, 3]").assert_ok()
    try:
        result = _ok_result(ddp, "%%ddp --nprocs 2\n[z * 2 for z in xs], {z: 0 for z in 'a'}")
        assert result == "([2, 4, 6], {'a': 0})"
        assert _ok_result(ddp, "type(z).__name__") == "'lock'"
    finally:
        ddp.run("del z").assert_ok()


@pytest.mark.fast
def test_failing_rank_shows_the_cells_own_lines(ddp):
    run = ddp.run("""
        %%ddp --nprocs 2
        import time
        import torch.distributed as dist
        rank = dist.get_rank()
        if rank == 1:
            time.sleep(0.5)  # rank 0 is surely waiting in the barrier
            raise ValueError(f"rank {rank} is unhappy")
        print("rank 0 waits at the barrier", flush=True)
        dist.barrier()
    """)
    error = run.error()
    assert error is not None and error["ename"] == "WorkerError", run.describe()
    count = _reply(ddp, run)["execution_count"]
    text = run.error_text()
    assert "rank 1" in text, text
    assert f"Cell In[{count}], line 7" in text, text  # the raise, counting %%ddp as 1
    assert 'raise ValueError(f"rank {rank} is unhappy")' in text, text
    assert "ValueError: rank 1 is unhappy" in text, text
    assert "nbddp/_worker.py" not in text and "nbddp/_cell.py" not in text, text
    assert "rank 0 waits at the barrier" in run.shown_text(), run.describe()
    # What a user can inspect afterwards: the exception IPython keeps.
    result = _ok_result(ddp, """
        import sys
        err = sys.last_value
        (type(err).__name__, isinstance(err, nbddp.WorkerError), err.rank,
         "unhappy" in err.traceback, sorted(err.logs))
    """)
    assert result == "('WorkerError', True, 1, True, [0, 1])"
    assert not descendants(ddp.pid)


@pytest.mark.slow
def test_unused_large_object_is_not_shipped(ddp):
    ddp.run("big = bytes(500 * 2**20)").assert_ok()
    try:
        unused = ddp.run("%%ddp --nprocs 2\nsmall = 3\nsmall * 2").assert_ok()
        assert unused.result() == "6", unused.describe()
        assert "payload is" not in unused.stream_text("stderr"), unused.describe()

        started = time.monotonic()
        used = ddp.run("%%ddp --nprocs 2\nlen(big)").assert_ok()
        assert used.result() == str(500 * 2**20), used.describe()
        assert time.monotonic() - started < 40, "shipping 500 MB took too long"
        warning = used.stream_text("stderr")
        assert "nbddp payload is 500 MB" in warning and "'big'" in warning, used.describe()
    finally:
        ddp.run("del big").assert_ok()


# --- interrupt ------------------------------------------------------------------------


def test_interrupt_stops_every_process_and_the_next_cell_works(fresh_kernel):
    fresh_kernel.run("%load_ext nbddp").assert_ok()
    run = fresh_kernel.submit("""
        %%ddp --nprocs 2
        import time
        import torch.distributed as dist
        print(f"rank {dist.get_rank()} is sleeping", flush=True)
        time.sleep(300)
    """)
    procs, _ = _wait_for_ranks(fresh_kernel, run)

    interrupt_and_check(fresh_kernel, run, procs)
    assert len(_summary_lines(run)) == 1, run.describe()
    header = _last_panel_header(run, "nbddp: interrupted")
    assert "(ranks: 0 stopped, 1 stopped)" in header, header  # by nbddp: not failed

    again = fresh_kernel.run("%%ddp --nprocs 2\n'still here'").assert_ok()
    assert again.result() == "'still here'"
