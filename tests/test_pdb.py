"""pdb on a rank: ``breakpoint()`` in a launched function opens pdb in the notebook cell.

Through a real kernel, as a notebook front end does: the kernel asks for each line on
its stdin channel (``input_request``), the test answers ``p x`` then ``c``, and the run
returns. Two ranks at a breakpoint are asked together (``[ranks 0,1] (Pdb) ``), their
answers labelled, or singly with ``@1``. A rank that raises opens a post-mortem with
``--pdb`` (``%pdb on``, ``pdb=True``), and a session's with ``%ddp_debug``. Where
nobody can answer (a ``wait=False`` run, a front end that takes no input), the
breakpoint is skipped with a message instead of ``BdbQuit``, and ``PYTHONBREAKPOINT=0``
turns it off.
"""

from __future__ import annotations

import re
from queue import Empty

import pytest

import nbddp

from .kernel_driver import Execution

pytestmark = pytest.mark.waits  # the waiting lane (tests/conftest.py)

STOPS = """
def stops(ranks):
    import torch.distributed as dist

    x = 40 + dist.get_rank()
    if dist.get_rank() in ranks:
        breakpoint()
    dist.barrier()
    return x + 2
"""


def answer(execution: Execution, prompt: str, line: str, timeout: float = 60) -> None:
    """Wait for the cell's input request, check its prompt, and type ``line``."""
    kc = execution.kernel.kc
    try:
        msg = kc.get_stdin_msg(timeout=timeout)
    except Empty:
        while execution._pump(0.5) and execution.idle_at is None:
            pass  # what the cell showed instead
        raise AssertionError(f"no {prompt!r} within {timeout} s:\n"
                             f"{execution.describe()}") from None
    assert msg["msg_type"] == "input_request", msg
    assert msg["content"]["prompt"] == prompt, msg["content"]
    kc.input(line)


def test_breakpoint_on_rank_0_opens_pdb_in_the_cell(kernel):
    kernel.run("import nbddp\n" + STOPS).assert_ok()
    cell = kernel.submit("nbddp.launch(stops, nprocs=2, args=([0],))")
    answer(cell, "[rank 0] (Pdb) ", "p x")
    answer(cell, "[rank 0] (Pdb) ", "c")
    cell.finish(timeout=60).assert_ok()
    assert cell.result() == "42"
    out = cell.stream_text()
    assert re.search(r"^> Cell In\[\d+\]\(9\)stops\(\)\n-> dist.barrier\(\)$", out, re.M), out
    assert "\n40\n" in out  # what `p x` printed on rank 0


def test_ranks_at_a_breakpoint_are_asked_together_and_answer_labelled(kernel):
    kernel.run("import nbddp\n" + STOPS).assert_ok()
    cell = kernel.submit("nbddp.launch(stops, nprocs=2, args=([0, 1],), all_ranks=True)")
    answer(cell, "[ranks 0,1] (Pdb) ", "p x")  # both ranks, one prompt
    answer(cell, "[ranks 0,1] (Pdb) ", "@1 p x * 10")  # rank 1 only
    answer(cell, "[ranks 0,1] (Pdb) ", "@3 p x")  # no such rank at a prompt
    answer(cell, "[ranks 0,1] (Pdb) ", "c")  # both go on
    cell.finish(timeout=60).assert_ok()
    assert cell.result() == "[42, 43]"
    out = cell.stream_text()
    assert "[rank 0] 40\n[rank 1] 41\n" in out, out  # labelled, in rank order
    assert "[rank 1] 410\n" in out and "[rank 0] 400" not in out, out
    assert "nbddp: rank 3 is not at a pdb prompt; these are: 0, 1" in out, out
    assert re.search(r"^\[rank 1\] > Cell In\[\d+\]\(9\)stops\(\)$", out, re.M), out


def test_a_rank_that_steps_off_the_end_of_its_function_leaves_the_others_asked(kernel):
    """``r`` then ``n`` leaves the function; pdb does not stop in nbddp's own frames, and
    once the rank has reported, the other rank is asked alone."""
    kernel.run("import nbddp\n" + STOPS.replace("    dist.barrier()\n", "")).assert_ok()
    cell = kernel.submit("nbddp.launch(stops, nprocs=2, args=([0, 1],), all_ranks=True)")
    answer(cell, "[ranks 0,1] (Pdb) ", "@0 r")  # to the function's return
    answer(cell, "[ranks 0,1] (Pdb) ", "@0 n")  # off its end: into nbddp's frames, skipped
    answer(cell, "[rank 1] (Pdb) ", "c")
    cell.finish(timeout=60).assert_ok()
    assert cell.result() == "[42, 43]"
    assert "nbddp/_rank" not in cell.stream_text()


def test_a_frontend_without_input_skips_the_breakpoint_and_says_why(kernel):
    kernel.run("import nbddp\n" + STOPS).assert_ok()
    msg_id = kernel.kc.execute("nbddp.launch(stops, nprocs=2, args=([1],))", allow_stdin=False)
    cell = Execution(kernel, msg_id)
    kernel.executions[msg_id] = cell
    cell.finish(timeout=60).assert_ok()
    assert cell.result() == "42"
    assert ("pdb on rank 1 skipped: this frontend takes no input"
            in cell.stream_text()), cell.describe()


def test_a_run_nobody_waits_for_skips_the_breakpoint(kernel):
    kernel.run("import nbddp\n" + STOPS).assert_ok()
    kernel.run("job = nbddp.launch(stops, nprocs=2, args=([0],), wait=False)").assert_ok()
    done = kernel.run("import time\nwhile not job.done(): time.sleep(0.1)\n"
                      "job.result(), 'skipped: no cell waits for this run' in job.logs[0]")
    done.assert_ok()
    assert done.result() == "(42, True)"


def test_pythonbreakpoint_0_turns_breakpoints_off(kernel):
    kernel.run("import nbddp\n" + STOPS).assert_ok()
    cell = kernel.run("nbddp.launch(stops, nprocs=2, args=([0, 1],), "
                      "env={'PYTHONBREAKPOINT': '0'})").assert_ok()
    assert cell.result() == "42"


def stops_here():
    import pdb

    pdb.set_trace()
    return "went on"


def test_pdb_set_trace_outside_a_notebook_cell_is_skipped_not_bdbquit():
    """Under pytest stdin is captured: nothing can take the input."""
    assert nbddp.launch(stops_here, nprocs=1) == "went on"


@pytest.mark.slurm
@pytest.mark.slow
def test_a_slurm_rank_skips_its_breakpoint_and_says_why(slurm_env, jobs, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
    job = nbddp.launch(stops_here, nprocs=1, cluster=nbddp.Slurm(), wait=False)
    jobs.append(job.cluster_job_id)
    assert job.result(timeout=120) == "went on"
    assert "cannot take input from the notebook" in job.logs[0]


# --- post-mortem ----------------------------------------------------------------------

FAILS_ON_RANK_1 = """%%ddp --nprocs 2{flags}
import torch.distributed as dist
x = 40 + dist.get_rank()
if dist.get_rank() == 1:
    y = x / 0
"""


def test_ddp_pdb_opens_pdb_at_the_failing_frame_of_the_rank_that_raised(kernel):
    kernel.run("%load_ext nbddp").assert_ok()
    cell = kernel.submit(FAILS_ON_RANK_1.format(flags=" --pdb"))
    answer(cell, "[rank 1] (Pdb) ", "p x")
    answer(cell, "[rank 1] (Pdb) ", "q")
    cell.finish(timeout=60)
    assert cell.error()["ename"] == "WorkerError", cell.describe()  # raised as without pdb
    assert "rank 1 raised ZeroDivisionError: division by zero" in cell.error_text()
    out = cell.stream_text()
    assert "nbddp: rank 1 raised ZeroDivisionError: division by zero\npost-mortem" in out, out
    assert re.search(r"^> Cell In\[\d+\]\(5\)<module>\(\)\n-> y = x / 0$", out, re.M), out
    assert "\n41\n" in out  # rank 1's x


def test_percent_pdb_on_is_honoured_and_ipython_does_not_debug_the_kernel_after(kernel):
    kernel.run("%load_ext nbddp\n%pdb on").assert_ok()
    try:
        cell = kernel.submit(FAILS_ON_RANK_1.format(flags=""))
        answer(cell, "[rank 1] (Pdb) ", "p x + 1")
        answer(cell, "[rank 1] (Pdb) ", "q")
        cell.finish(timeout=60)  # no second prompt: IPython's own debugger stays shut
        assert cell.error()["ename"] == "WorkerError", cell.describe()
        assert "\n42\n" in cell.stream_text()
        assert kernel.run("get_ipython().call_pdb").assert_ok().result() == "True"  # still on
    finally:
        kernel.run("%pdb off")


FAILS_WITH = """
def fails_with(value):
    local = value * 2
    raise ValueError(f"bad {local}")
"""


def test_launch_pdb_true_debugs_the_function(kernel):
    kernel.run("import nbddp\n" + FAILS_WITH).assert_ok()
    cell = kernel.submit("nbddp.launch(fails_with, nprocs=1, args=(21,), pdb=True)")
    answer(cell, "[rank 0] (Pdb) ", "p local")
    answer(cell, "[rank 0] (Pdb) ", "c")  # goes on: the error is raised
    cell.finish(timeout=60)
    assert cell.error()["ename"] == "WorkerError", cell.describe()
    assert "\n42\n" in cell.stream_text()


def test_without_pdb_a_failing_rank_reports_at_once(kernel):
    kernel.run("%load_ext nbddp").assert_ok()
    run = kernel.run(FAILS_ON_RANK_1.format(flags=""), timeout=90)
    assert run.error()["ename"] == "WorkerError" and "(Pdb)" not in run.stream_text()


def test_ddp_debug_after_a_failed_session_cell_debugs_the_rank_that_raised(fresh_kernel):
    fresh_kernel.run("%load_ext nbddp\n%ddp_session start --nprocs 2").assert_ok()
    try:
        # x is the ranks' before the failing cell: rank 0 may be interrupted before that
        # cell's code starts there (rank 1 fails at once), and then runs none of it.
        fresh_kernel.run("%%ddp\nimport torch.distributed as dist\nx = 40 + dist.get_rank()",
                         timeout=90).assert_ok()
        failed = fresh_kernel.run("%%ddp\nif dist.get_rank() == 1:\n    y = x / 0", timeout=90)
        assert failed.error()["ename"] == "WorkerError", failed.describe()
        cell = fresh_kernel.submit("%ddp_debug")
        answer(cell, "[rank 1] (Pdb) ", "p x")
        answer(cell, "[rank 1] (Pdb) ", "q")
        cell.finish(timeout=60).assert_ok()
        assert "\n41\n" in cell.stream_text()
        again = fresh_kernel.run("%ddp_debug", timeout=60).assert_ok()  # used: nothing kept
        assert "no rank of the session kept a failure" in again.stream_text()
        kept = fresh_kernel.run("%%ddp\nx", timeout=60).assert_ok()
        assert kept.result() == "40"  # the state is the session's still
    finally:
        fresh_kernel.run("%ddp_session stop")  # (a session of its own: nothing carries over)


def test_ddp_debug_needs_a_session(kernel):
    kernel.run("%load_ext nbddp").assert_ok()
    run = kernel.run("%ddp_debug")
    assert "UsageError" in run.stream_text("stderr") or run.error() is not None
    assert "a one-off cell's ranks are gone" in run.describe()


def test_q_at_a_breakpoint_under_pdb_opens_no_second_pdb(kernel):
    kernel.run("%load_ext nbddp").assert_ok()
    cell = kernel.submit("%%ddp --nprocs 1 --pdb\nx = 1\nbreakpoint()\nx")
    answer(cell, "[rank 0] (Pdb) ", "q")  # BdbQuit: the user's own end, no post-mortem
    cell.finish(timeout=60)
    assert cell.error()["ename"] == "WorkerError", cell.describe()
    assert "raised BdbQuit" in cell.error_text() and "post-mortem" not in cell.stream_text()


def test_an_interrupt_at_a_post_mortem_prompt_stops_the_run(fresh_kernel):
    fresh_kernel.run("%load_ext nbddp").assert_ok()
    cell = fresh_kernel.submit(FAILS_ON_RANK_1.format(flags=" --pdb"))
    msg = fresh_kernel.kc.get_stdin_msg(timeout=60)
    assert msg["content"]["prompt"] == "[rank 1] (Pdb) ", msg
    fresh_kernel.km.interrupt_kernel()  # the stop button, while the prompt waits
    cell.finish(timeout=60)
    assert cell.error()["ename"] == "KeyboardInterrupt", cell.describe()
    assert fresh_kernel.run("1 + 1").assert_ok().result() == "2"  # the kernel goes on
