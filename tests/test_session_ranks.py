"""A session's cell on some ranks (``%%ddp --ranks``, ``Session.run(fn, ranks=...)``),
through a real kernel: the others stay at rest with their state, the value, ``--out``
and the output come from the ranks named, and a collective in such a cell says which
ranks it waits for in vain."""

from __future__ import annotations

import pytest

from .kernel_driver import Kernel
from .test_session import cell, kernel_with_session

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rkernel(tmp_path_factory):
    with kernel_with_session(tmp_path_factory.mktemp("ranks")) as kernel:
        cell(kernel, "import torch.distributed as dist\nx = dist.get_rank()").assert_ok()
        yield kernel


@pytest.fixture
def own_session(tmp_path):
    """A kernel and session of the test's own (it restarts its ranks)."""
    with kernel_with_session(tmp_path) as kernel:
        yield kernel


def everyones_x(kernel: Kernel) -> str:
    run = cell(kernel, "seen = [None] * dist.get_world_size()\n"
                       "dist.all_gather_object(seen, x)\nseen").assert_ok()
    return run.result()


def test_a_cell_on_one_rank_leaves_the_others_state_as_it_was(rkernel):
    run = cell(rkernel, "x = x + 100\nprint('rank', dist.get_rank(), 'ran it', flush=True)\nx",
               "--ranks 1").assert_ok()
    assert run.result() == "101"  # the value of the lowest rank named
    assert "rank 1 ran it" in run.stream_text()  # its output is the one shown
    assert everyones_x(rkernel) == "[0, 101]"
    cell(rkernel, "x = dist.get_rank()").assert_ok()


def test_out_and_every_ranks_output_come_from_the_ranks_named(rkernel):
    run = cell(rkernel, "y = dist.get_rank() * 10\nprint('from', dist.get_rank(), flush=True)",
               "--ranks 1: --out y --all-ranks").assert_ok()
    assert rkernel.run("y").result() == "10"
    text = run.stream_text()
    assert "[rank 1] from 1" in text and "[rank 0]" not in text, text


def test_the_panel_shows_the_ranks_left_at_rest(rkernel):
    run = cell(rkernel, "import time\ntime.sleep(0.5)", "--ranks 0").assert_ok()
    shown = [o for o in run.outputs if o.msg_type in ("display_data", "update_display_data")]
    assert "(ranks: 0 finished, 1 resting)" in shown[-1].content["data"]["text/plain"]


def test_a_collective_in_a_cell_on_some_ranks_names_the_ranks_it_waits_for(own_session):
    run = cell(own_session, "import torch.distributed as dist\ndist.barrier()",
               "--ranks 0 --timeout 3")
    error = run.error()
    assert error is not None and error["ename"] == "TimeoutError", run.describe()
    text = "\n".join(error["traceback"])
    assert ("ranks 1 are at rest: this run is on ranks 0 only, so a collective in it "
            "waits for them forever") in text, text
    assert "rank 0: waiting in barrier" in text
    # gloo's barrier cannot be interrupted: rank 0 never comes back to rest, so the
    # session starts fresh ranks, and says so.
    assert "the session was restarted: variables defined in earlier cells are gone" in text


@pytest.mark.parametrize(("ranks", "said"), [
    ("2", "the session has ranks 0 to 1; there is no rank 2"),
    ("one", "--ranks takes rank numbers and slices such as 0, 0,3 or 1:, got 'one'"),
    ("5:", "ranks is empty: name at least one rank"),
])
def test_ranks_the_session_does_not_have_are_refused(rkernel, ranks, said):
    err = cell(rkernel, "x", f"--ranks {ranks}").assert_ok().stream_text("stderr")
    assert f"UsageError: {said}" in err, err


def test_the_python_api_takes_ranks_too(rkernel):
    run = rkernel.run("""
        def bump():
            global counter
            counter = globals().get("counter", 0) + 1
            return counter

        with nbddp.Session(nprocs=2) as session:
            session.run(bump)
            once_more = session.run(bump, ranks=[1])
            counters = session.run_all(lambda: counter)
            only_one = session.run_all(lambda: counter, ranks=[1])
            try:
                session.run(bump, ranks=[2])
            except ValueError as error:
                refused = str(error)
        (once_more, counters, only_one, refused)
    """, timeout=120).assert_ok()
    assert run.result() == ("(2, [1, 2], [2], 'the session has ranks 0 to 1; there is no "
                            "rank 2')")


def test_without_a_session_ranks_is_refused(rkernel):
    rkernel.run("%ddp_session stop").assert_ok()
    err = cell(rkernel, "1", "--ranks 0").assert_ok().stream_text("stderr")
    assert "UsageError: --ranks runs a cell on some of a session's ranks" in err, err
