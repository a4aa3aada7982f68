"""Why is it stuck: stacks that read like a traceback, and what the ranks were doing
together (the hang report), on demand and before a timeout or an interrupt stops them.

Real launches: the stuck run (rank 1 in a helper, rank 0 waiting in ``dist.barrier()``)
ends by timeout with both places named, each rank's summary line on top and the barrier
said to wait for rank 1; a hang in the 12th ``all_reduce`` is reported with its number;
``Job.stacks()`` (and ``full=True``) while a run goes on; an interrupt carries both; a
session counts collectives across runs; in a kernel, the cell's lines and source text.
Unit tests of the rendering and of the report first.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

import nbddp
from nbddp._run.diagnosis.hang_report import HEADER, hang_report
from nbddp._run.diagnosis.stack_view import render, where
from nbddp._wire.hang_messages import Collectives, GroupProgress
from nbddp._wire.stacks import read_dump

from .conftest import wait_until

pytestmark = pytest.mark.waits  # the waiting lane (tests/conftest.py)

NBDDP = Path(nbddp.__file__).parent
TORCH = Path(importlib.util.find_spec("torch").origin).parent
THREADING = threading.__file__


def dump_of(threads: dict[str, list[tuple[str, int, str]]]) -> str:
    """A faulthandler dump: each thread's frames most recent call first, as it writes them."""
    return "\n".join(f"Thread {ident} (most recent call first):\n" + "".join(
        f'  File "{file}", line {line} in {function}\n' for file, line, function in frames)
        for ident, frames in threads.items())


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("import torch.distributed as dist\n\ndef helper():\n    wait_here()\n\n"
                    "def train():\n    dist.barrier()\n")
    return str(path)


def barrier_dump(user_file: str) -> str:
    return dump_of({
        "0x00000000000000aa": [  # nbddp's channel listener
            (THREADING, 331, "wait"), (str(NBDDP / "_rank/link.py"), 145, "_serve_channel"),
            (THREADING, 982, "run")],
        "0x00000000000000bb": [  # the main thread
            (str(TORCH / "distributed/distributed_c10d.py"), 5356, "barrier"),
            (str(TORCH / "distributed/c10d_logger.py"), 83, "wrapper"),
            (user_file, 7, "train"), (str(NBDDP / "_rank/loop.py"), 171, "_call"),
            ("<frozen runpy>", 88, "_run_code")],
        "0x00000000000000cc": [(user_file, 4, "helper")],  # the user's own thread
    })


def test_a_stack_reads_like_a_traceback_the_users_line_first(user_file):
    shown = render(0, barrier_dump(user_file), "0x00000000000000bb")
    assert shown.splitlines()[:5] == [
        "rank 0: waiting in barrier (train.py, line 7)",
        "Main thread (most recent call last):",
        f'  File "{user_file}", line 7, in train',
        "    dist.barrier()",
        "  [2 frames in torch: wrapper > barrier]"]
    assert "_rank/" not in shown and "runpy" not in shown  # nbddp's frames and thread
    assert "Thread 0x00000000000000cc (most recent call last):" in shown  # the user's thread
    assert "    wait_here()" in shown


def test_full_shows_every_frame_and_thread(user_file):
    shown = render(0, barrier_dump(user_file), "0x00000000000000bb", full=True)
    assert shown.startswith("rank 0: waiting in barrier (train.py, line 7)\nMain thread")
    assert shown.index("<frozen runpy>") < shown.index("_rank/loop.py") < shown.index(
        "c10d_logger.py") < shown.index("distributed_c10d.py")  # most recent call last
    assert "_serve_channel" in shown


def test_the_summary_names_the_innermost_user_frame_or_says_the_rank_is_in_nbddp(user_file):
    helper = dump_of({"0x1": [(THREADING, 331, "wait"), (user_file, 4, "helper"),
                              (user_file, 7, "train")]})
    assert render(3, helper, "0x1").splitlines()[0] == (
        "rank 3: in wait (threading) (train.py, line 4)")
    own = dump_of({"0x1": [(user_file, 4, "helper"), (user_file, 7, "train")]})
    assert render(3, own, "0x1").splitlines()[0] == "rank 3: in helper (train.py, line 4)"
    loop = str(NBDDP / "_rank/loop.py")
    at_rest = dump_of({"0x1": [(THREADING, 331, "wait"), (loop, 90, "next_start")]})
    assert render(3, at_rest, "0x1").splitlines()[:3] == [
        "rank 3: in nbddp's next_start, not in the user's code",
        "Main thread (most recent call last):",
        f'  File "{THREADING}", line 331, in wait']


def test_torchs_frames_fold_into_one_line_across_the_import_machinery(user_file):
    importing = [(str(TORCH / f"m{i}.py"), 1, "<module>") for i in range(5)]
    between = [frame for pair in zip(importing, [("<frozen importlib._bootstrap>", 241,
                                                  "_call_with_frames_removed")] * 5,
                                     strict=True) for frame in pair]
    dump = dump_of({"0x1": [*between, (user_file, 1, "<module>")]})
    assert render(0, dump, "0x1").splitlines()[4:] == [
        "  [5 frames in torch: <module> > <module> > ... > <module>]"]


def test_where_puts_every_ranks_summary_and_the_hang_report_on_top(user_file):
    stacks = {r: render(r, barrier_dump(user_file), "0x00000000000000bb") for r in (0, 1)}
    text = where(stacks, "collectives: ...")
    assert text.splitlines()[:4] == ["where each rank was:",
                                     "rank 0: waiting in barrier (train.py, line 7)",
                                     "rank 1: waiting in barrier (train.py, line 7)",
                                     "collectives: ..."]
    assert text.index("--- rank 0 ---") < text.index("--- rank 1 ---")
    assert "Thread 0x00000000000000cc" not in text  # the main threads only


def progress(completed, entered, op="all_reduce", waiting="all_reduce", since=None, group="0"):
    return GroupProgress(group, "default_pg", completed, entered, op,
                         waiting if entered > completed else "", since)


def test_the_hang_report_names_the_collective_and_who_it_waits_for():
    answers = {0: Collectives(0, 1, (progress(11, 12, since=100.0),)),
               1: Collectives(1, 1, (progress(11, 11),)),
               2: Collectives(2, 1, (progress(11, 12, since=95.0),))}
    assert hang_report(answers, range(4), now=110.0).splitlines()[1:] == [
        "rank 0: waits in all_reduce #12 (for 10 s)",
        "rank 1: has completed #11 (all_reduce) and is not in a collective",
        "rank 2: waits in all_reduce #12 (for 15 s)",
        "all_reduce #12 waits for rank 1, which has not entered it",
        "rank 3: did not answer (its link to the kernel is gone, or its Python is held by "
        "native code)"]


def test_the_hang_report_tells_a_rank_still_starting_from_one_that_does_not_answer():
    lines = hang_report({}, [0, 1], starting={1}).splitlines()
    assert lines[1:] == [
        "rank 0: did not answer (its link to the kernel is gone, or its Python is held by "
        "native code)",
        "rank 1: still starting (it had not said hello to the kernel yet)"]


def test_the_hang_report_sees_ranks_disagree_on_a_collective():
    answers = {0: Collectives(0, 1, (progress(4, 5, waiting="all_reduce"),)),
               1: Collectives(1, 1, (progress(4, 5, waiting="broadcast"),))}
    lines = hang_report(answers, [0, 1]).splitlines()
    assert "the ranks disagree on collective #5: rank 0 all_reduce, rank 1 broadcast" in lines


def test_the_hang_report_per_process_group_and_without_a_recorder():
    answers = {0: Collectives(0, 1, (progress(3, 3), progress(0, 1, group="1", since=None))),
               1: Collectives(1, 1, (), unavailable="no process group")}
    lines = hang_report(answers, [0, 1]).splitlines()
    assert lines[1:] == [
        "process group default_pg (1 ranks):",
        "  rank 0: has completed #3 (all_reduce) and is not in a collective",
        "process group default_pg (1 ranks):",
        "  rank 0: waits in all_reduce #1",
        "rank 1: no record of its collectives (no process group)"]


def test_a_rank_that_does_not_answer_gives_nothing(tmp_path):
    assert read_dump(tmp_path / "stacks-0.txt", 0, wait=0.2) is None


def test_a_dump_that_pauses_before_the_main_thread_is_read_whole(tmp_path):
    """faulthandler writes the main thread last; a rank that loses the CPU between two
    threads pauses mid-dump, and the pause is not the end."""
    path = tmp_path / "stacks-0.txt"
    other = "Thread 0x2 (most recent call first):\n  File \"x.py\", line 1 in wait\n\n"
    main = ("Thread 0x1 (most recent call first):\n  File \"y.py\", line 2 in train\n"
            "  File \"<frozen runpy>\", line 198 in _run_module_as_main\n")
    path.write_text(other)

    def rest_of_it():
        time.sleep(0.2)  # four polls without growth
        with open(path, "a") as f:
            f.write(main)

    threading.Thread(target=rest_of_it).start()
    assert read_dump(path, 0, wait=2.0, main="0x1") == other + main


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


def hang_in_all_reduce_12(started):
    import pathlib

    import torch
    import torch.distributed as dist

    tensor = torch.ones(3)
    for _ in range(11):
        dist.all_reduce(tensor)
    pathlib.Path(started, f"rank-{dist.get_rank()}").touch()
    if dist.get_rank() == 1:
        stuck_in_helper(600)
    dist.all_reduce(tensor)


def hang_in_ddp_backward(started):
    import pathlib

    import torch
    import torch.distributed as dist

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
    pathlib.Path(started, f"rank-{dist.get_rank()}").touch()
    if dist.get_rank() == 1:
        stuck_in_helper(600)
    model(torch.ones(2, 4)).sum().backward()


def report_naming(job, words: str, timeout: float = 30) -> str:
    """The job's hang report once it names ``words``; failing, the last one it gave."""
    said = []

    def names_them() -> str | None:
        said.append(job.hang_report())
        return said[-1] if words in said[-1] else None

    try:
        return wait_until(names_them, timeout=timeout)
    except AssertionError:
        raise AssertionError(f"no hang report named {words!r} within {timeout} s; the "
                             f"last said:\n{said[-1] if said else '(none)'}") from None


def both_started(folder) -> None:
    wait_until(lambda: len(list(folder.glob("rank-*"))) == 2, timeout=60)


def test_a_timeout_says_where_each_rank_was_and_who_waits_for_whom():
    job = nbddp.launch(stuck_run, 2, timeout=10, wait=False)
    with pytest.raises(TimeoutError) as caught:
        job.result()
    error = caught.value
    assert error.stacks[0].startswith("rank 0: waiting in barrier (test_stacks.py, line ")
    assert error.stacks[1].startswith("rank 1: in stuck_in_helper (test_stacks.py, line ")
    lines = str(error).splitlines()
    assert lines[:4] == ["the run did not finish within 10 s; every rank was stopped",
                         "where each rank was:", error.stacks[0].splitlines()[0],
                         error.stacks[1].splitlines()[0]]
    assert lines[4] == HEADER and lines[5].startswith("rank 0: waits in barrier #1 (for ")
    assert lines[6:8] == ["rank 1: has entered no collective yet",
                          "barrier #1 waits for rank 1, which has not entered it"]
    text = str(error)
    assert text.index("--- rank 0 ---") < text.index("    dist.barrier()") < text.index(
        "--- rank 1 ---") < text.index("    stuck_in_helper(600)") < text.index(
        "    time.sleep(seconds)")  # each frame with its source line, most recent call last
    assert "distributed_c10d.py" not in text and "nbddp/_rank" not in text
    assert "[2 frames in torch: wrapper > barrier]" in text
    kept = (job.records / "stacks.txt").read_text()
    assert error.stacks[1] in kept and error.hang_report in kept


def test_a_hang_in_the_12th_all_reduce_is_reported_with_its_number(tmp_path):
    job = nbddp.launch(hang_in_all_reduce_12, 2, args=(str(tmp_path),), wait=False,
                       timeout=120)
    try:
        both_started(tmp_path)
        report = report_naming(job, "#12")
        assert report.splitlines()[2:] == [
            "rank 1: has completed #11 (all_reduce) and is not in a collective",
            "all_reduce #12 waits for rank 1, which has not entered it"]
        assert report.splitlines()[1].startswith("rank 0: waits in all_reduce #12 (for ")
        assert not job.done()  # asking stopped nothing
    finally:
        job.cancel()
    assert job.hang_report() == "the run has ended: no rank is in a collective"


def test_with_the_flight_recorder_off_the_process_groups_count_and_the_stack_say_it(tmp_path):
    job = nbddp.launch(hang_in_all_reduce_12, 2, args=(str(tmp_path),), wait=False,
                       timeout=120, env={"TORCH_FR_BUFFER_SIZE": "0"})
    try:
        both_started(tmp_path)
        report = report_naming(job, "#12")
        assert report.splitlines()[1:] == [
            "rank 0: waits in all_reduce #12",
            "rank 1: has completed #11 and is not in a collective",
            "all_reduce #12 waits for rank 1, which has not entered it",
            "ranks 0, 1: counted by the process groups, as torch's flight recorder is off "
            "(TORCH_FR_BUFFER_SIZE=0); the collective a rank waits in is read from its stack"]
    finally:
        job.cancel()


@pytest.mark.parametrize("recorder", ["on", "off"])
def test_a_rank_waiting_in_ddps_gradient_all_reduce_is_named_with_the_rank_it_waits_for(
        tmp_path, recorder):
    env = {"TORCH_FR_BUFFER_SIZE": "0"} if recorder == "off" else {}
    job = nbddp.launch(hang_in_ddp_backward, 2, args=(str(tmp_path),), wait=False,
                       timeout=120, env=env)
    try:
        both_started(tmp_path)
        report = wait_until(lambda: "waits for rank 1" in (r := job.hang_report()) and r,
                            timeout=30)
        lines = report.splitlines()
        waits = re.match(r"rank 0: waits in all_reduce(?: \(in backward\))? #(\d+)", lines[1])
        assert waits, report
        number = int(waits[1])  # (DDP's construction and backwards: several collectives)
        assert lines[2].startswith(f"rank 1: has completed #{number - 1}"), report
        assert re.fullmatch(rf"all_reduce.* #{number} waits for rank 1, which has not "
                            "entered it", lines[3]), report
    finally:
        job.cancel()


def test_stacks_are_taken_while_the_run_goes_on(tmp_path):
    job = nbddp.launch(stuck_run, 2, args=(str(tmp_path),), wait=False, timeout=120)
    try:
        both_started(tmp_path)
        stacks = job.stacks()
        assert set(stacks) == {0, 1}
        assert stacks[1].startswith("rank 1: in stuck_in_helper (test_stacks.py, line ")
        assert "nbddp/_rank/loop.py" not in stacks[1]
        full = job.stacks(full=True)
        assert "nbddp/_rank/loop.py" in full[1] and "_serve_channel" in full[1]  # every thread
        assert "distributed_c10d.py" in full[0]
        assert not job.done()  # taking them stopped nothing
    finally:
        job.cancel()
    assert job.stacks() == {}  # the ranks are gone


def test_an_interrupt_carries_the_stacks_and_the_hang_report(tmp_path):
    def interrupt_when_started():
        both_started(tmp_path)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_started, daemon=True).start()
    with pytest.raises(KeyboardInterrupt) as caught:
        nbddp.launch(stuck_run, 2, args=(str(tmp_path),))
    assert caught.value.stacks[1].startswith("rank 1: in stuck_in_helper")
    assert "barrier #1 waits for rank 1" in caught.value.hang_report


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


def test_in_a_kernel_the_timeout_reads_like_a_traceback_of_the_cell(kernel):
    kernel.run("import nbddp").assert_ok()
    run = kernel.run(STUCK_CELL, timeout=90)
    assert run.error() is not None and run.error()["ename"] == "TimeoutError", run.describe()
    text = run.error_text()
    cell = re.search(r"Cell In\[\d+\]", text).group(0)
    assert f"rank 0: waiting in barrier ({cell}, line 9)" in text, text
    assert f"rank 1: in helper ({cell}, line 3)" in text, text
    rank_0, rank_1 = text.split("--- rank 0 ---")[1].split("--- rank 1 ---")
    assert f"  {cell}, line 9, in stuck\n    dist.barrier()" in rank_0, rank_0
    assert (f"  {cell}, line 8, in stuck\n    helper()\n"
            f"  {cell}, line 3, in helper\n    time.sleep(600)") in rank_1, rank_1
    where = text[text.index("where each rank was:"):]  # (IPython shows the cell above it)
    assert "distributed_c10d" not in where and "nbddp/_rank" not in where
    assert "runpy" not in where


def all_reduce_times(n):
    import torch
    import torch.distributed as dist

    for _ in range(n):
        dist.all_reduce(torch.ones(1))


def test_in_a_session_the_count_goes_on_across_runs_and_the_timeout_says_where(tmp_path):
    with nbddp.Session(nprocs=2) as session:
        session.run(all_reduce_times, 3)
        job = session.submit(hang_in_all_reduce_12, (str(tmp_path),), timeout=20)
        both_started(tmp_path)
        report = wait_until(lambda: "#15" in (r := job.hang_report()) and r, timeout=15)
        assert "all_reduce #15 waits for rank 1, which has not entered it" in report
        assert job.stacks()[1].startswith("rank 1: in stuck_in_helper (")
        with pytest.raises(TimeoutError) as caught:
            job.result()
        assert caught.value.stacks[1].startswith("rank 1: in stuck_in_helper (")
        assert "all_reduce #15 waits for rank 1" in caught.value.hang_report
        assert str(caught.value).startswith(  # (rank 0 cannot leave its all_reduce)
            "the run did not finish within 20 s; the session was restarted: variables defined "
            "in earlier cells are gone\nwhere each rank was:\nrank 0: waiting in all_reduce (")


def test_a_subgroups_progress_is_named_as_every_rank_names_it():
    """The recorder's status is keyed by the group's id in this process (ranks outside a
    subgroup make none, so ids differ across ranks); its entries carry the group's name."""
    from nbddp._rank.collectives import _progress_in

    def entry(number, op, created=None):
        return {"pg_id": 1, "process_group": ("5", "tp"), "collective_seq_id": number,
                "profiling_name": f"gloo:{op}", "time_created_ns": created, "is_p2p": False}

    trace = {"pg_status": {"0": {"last_completed_collective": -1,
                                 "last_enqueued_collective": -1},
                           "1": {"last_completed_collective": 2, "last_enqueued_collective": 3}},
             "entries": [entry(1, "broadcast"), entry(2, "all_reduce"),
                         entry(3, "all_gather", 7_000_000_000)]}
    default, tp = _progress_in([trace])
    assert default == GroupProgress("0", "default_pg", 0, 0)
    assert tp == GroupProgress("5", "tp", 2, 3, "all_reduce", "all_gather", 7.0)


def test_a_recorder_that_lags_behind_the_groups_own_count_is_corrected_by_it():
    """gloo marks a collective completed some time after it returned: the recorder may
    still show a rank that has left its 11th all-reduce as waiting in its 10th."""
    from nbddp._rank.collectives import _progress_in

    entries = [{"pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": n,
                "profiling_name": "gloo:all_reduce", "time_created_ns": n * 10**9,
                "is_p2p": False} for n in range(1, 13)]
    trace = {"pg_status": {"0": {"last_completed_collective": 9,
                                 "last_enqueued_collective": 10}}, "entries": entries}
    resting = {"0": GroupProgress("0", "default_pg", 11, 11)}
    waiting = {"0": GroupProgress("0", "default_pg", 11, 12, "", "all_reduce")}
    assert _progress_in([trace], resting) == (
        GroupProgress("0", "default_pg", 11, 11, "all_reduce"),)
    assert _progress_in([trace], waiting) == (
        GroupProgress("0", "default_pg", 11, 12, "all_reduce", "all_reduce", 12.0),)
    assert _progress_in([trace], {}) == (  # (nothing to check it against: as recorded)
        GroupProgress("0", "default_pg", 9, 10, "all_reduce", "all_reduce", 10.0),)
