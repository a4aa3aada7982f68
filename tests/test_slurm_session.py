"""Sessions on the two-node SLURM test cluster, through a real kernel: one job holds the
nodes, and every ``%%ddp`` cell runs on both nodes' ranks, keeping their state.

``%ddp_session start --slurm`` submits the job and returns once every rank waits; cells
then run as in a local session (names kept on the ranks, notebook names by value, the
failure rules). The job outlives its kernel, and a new kernel attaches to its ranks with
their state; stopping the session ends the job. Job processes are children of slurmd,
not of the kernel: each test checks the job has left the queue.
"""

from __future__ import annotations

import glob
import io
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

import nbddp

from .conftest import SHM, wait_until
from .kernel_driver import Kernel
from .slurm import SLURM_DIR, job_ended, resume_node, slurm
from .test_kernel import _alive, _snapshot
from .test_pdb import answer
from .test_slurm_submit import setup_cell

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.waits]

START = "%ddp_session start --slurm --nodes 2 --nprocs 1 --time 00:10:00 --cpus-per-task 1"
JOB_ID = re.compile(r"SLURM job (\d+) is running on n\[1-2\]")


def start_session(kernel: Kernel, slurm_env: dict[str, str], jobs: list[str],
                  options: str = "") -> str:
    """Start a two-node session in ``kernel``; its job id."""
    kernel.run(setup_cell(slurm_env)).assert_ok()
    run = kernel.run(f"{START} {options}", timeout=120).assert_ok()
    match = JOB_ID.search(run.stream_text())
    assert match, run.describe()
    jobs.append(match.group(1))
    return match.group(1)


def session_pids(kernel: Kernel) -> dict[int, int]:
    run = kernel.run("_status = %ddp_session\n_status.pids").assert_ok()
    return eval(run.result())  # noqa: S307 - our own repr


def cell(kernel: Kernel, body: str, options: str = "", timeout: float = 60):
    return kernel.run(f"%%ddp {options}\n{body}", timeout=timeout)


def second_node_rank(kernel: Kernel) -> int:
    """The rank that runs on n2 (c10d's rendezvous numbers the nodes in any order)."""
    run = cell(kernel, """
import torch.distributed as dist
nodes = [None] * dist.get_world_size()
dist.all_gather_object(nodes, os.environ["SLURMD_NODENAME"])
nodes.index("n2")
""").assert_ok()
    return int(run.result())


@pytest.fixture(scope="module")
def session_jobs(slurm_env):
    """The module kernel's jobs (the per-test ``jobs`` fixture would cancel them after
    the first test); any still running at the end are cancelled, and waited for."""
    submitted: list[str] = []
    yield submitted
    for job_id in submitted:
        if not job_ended(slurm_env, job_id):
            slurm(slurm_env, "scancel", job_id)
        wait_until(lambda job_id=job_id: job_ended(slurm_env, job_id), timeout=60,
                   interval=0.2)


@pytest.fixture(scope="module")
def cluster_session(slurm_env, session_jobs, tmp_path_factory):
    """One kernel with a two-node session open, for the tests that keep it whole."""
    kernel = Kernel(tmp_path_factory.mktemp("slurm-session"))
    try:
        start_session(kernel, slurm_env, session_jobs)
        yield kernel
        kernel.run("%ddp_session stop").assert_ok()
    finally:
        kernel.shutdown()


@pytest.fixture
def fresh_cluster_session(slurm_env, jobs, tmp_path):
    kernel = Kernel(tmp_path)
    try:
        yield kernel, start_session(kernel, slurm_env, jobs)
    finally:
        kernel.shutdown()


# --- cells on both nodes ------------------------------------------------------------


def release_when_held(env: dict[str, str], name: str) -> threading.Thread:
    """Release the held job named ``name`` once SLURM lists it as pending (a thread), so
    that the session meets a job that really waits in the queue, however idle the
    cluster."""
    def release() -> None:
        held: list[str] = []
        def pending() -> bool:
            held[:] = slurm(env, "squeue", "--noheader", f"--name={name}",
                            "--states=PENDING", "--Format=JobID").split()
            return bool(held)
        wait_until(pending, timeout=60, interval=0.2)
        time.sleep(1.5)  # the session polls squeue every second: let it see the wait
        slurm(env, "scontrol", "release", held[0])
    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    return thread


def test_the_session_waits_for_its_job_and_says_where_it_runs(slurm_env, jobs, tmp_path):
    kernel = Kernel(tmp_path)
    try:
        kernel.run(setup_cell(slurm_env)).assert_ok()
        name = f"nbddp-held-{os.getpid()}-{time.monotonic_ns()}"
        releaser = release_when_held(slurm_env, name)
        run = kernel.run(f"{START} --sbatch=--hold --sbatch=--job-name={name}",
                         timeout=120).assert_ok()
        releaser.join(timeout=5)
        text = run.stream_text()
        job_id = JOB_ID.search(text).group(1)
        jobs.append(job_id)
        assert f"SLURM job {job_id} is queued (JobHeldUser)" in text, text  # the wait, live
        assert (f"the ranks outlive this kernel as long as the job runs: after a restart, "
                f"%ddp_session attach {job_id}") in text, text
        status = run.result()
        assert f"2 ranks (gloo) on SLURM job {job_id} on n[1-2]" in status, status
        assert "rank 1: pid" in status
        kernel.run("%ddp_session stop").assert_ok()
        assert job_ended(slurm_env, job_id)
    finally:
        kernel.shutdown()


def test_names_stay_on_both_nodes_and_notebook_names_follow_each_cell(cluster_session):
    cluster_session.run("scale = 2").assert_ok()
    cell(cluster_session, """
import torch.distributed as dist
node = os.environ["SLURMD_NODENAME"]
seen = [scale * (dist.get_rank() + 1)]
""").assert_ok()
    cluster_session.run("scale = 10").assert_ok()  # changed in the notebook between cells
    run = cell(cluster_session, """
seen.append(scale * (dist.get_rank() + 1))
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, (node, seen))
everyone
""").assert_ok()
    everyone = eval(run.result())  # noqa: S307 - our own repr
    assert sorted(node for node, _ in everyone) == ["n1", "n2"], run.describe()
    assert [seen for _, seen in everyone] == [[2, 10], [4, 20]]  # by rank


def test_a_cell_on_the_second_nodes_rank_and_an_edit_reloaded_on_both_nodes(cluster_session):
    rank = second_node_rank(cluster_session)
    cell(cluster_session, "mine = dist.get_rank()").assert_ok()
    run = cell(cluster_session, "mine += 100\nprint('ran on', os.environ['SLURMD_NODENAME'], "
                                "flush=True)\nmine", f"--ranks {rank}").assert_ok()
    assert run.result() == str(rank + 100) and "ran on n2" in run.stream_text(), run.describe()
    run = cell(cluster_session, "seen = [None] * dist.get_world_size()\n"
                                "dist.all_gather_object(seen, mine)\nseen").assert_ok()
    assert eval(run.result())[rank] == rank + 100  # noqa: S307 - and the other kept its own
    module = Path(cluster_session.run("import os; os.getcwd()").result().strip("'")) / "edits.py"
    module.write_text("def version():\n    return 1\n")
    cluster_session.run("%ddp_session autoreload on").assert_ok()
    run = cell(cluster_session, "import edits\nversions = [None] * dist.get_world_size()\n"
                                "dist.all_gather_object(versions, edits.version())\nversions")
    assert run.assert_ok().result() == "[1, 1]"
    module.write_text("def version():\n    return 2\n")
    later = time.time() + 2
    os.utime(module, (later, later))
    run = cell(cluster_session, "dist.all_gather_object(versions, edits.version())\nversions")
    assert run.assert_ok().result() == "[2, 2]"  # reloaded on both nodes
    cluster_session.run("%ddp_session autoreload off").assert_ok()


def test_the_notebooks_module_ships_to_each_node_of_the_job(cluster_session):
    """A cluster whose compute nodes do not mount the notebook's folder exists: the
    ranks import the notebook's module from the copy shipped into their node's own
    folder (this test cluster's nodes could see the original, so the test checks where
    each rank's module came from)."""
    folder = Path(cluster_session.run("import os; os.getcwd()").result().strip("'"))
    (folder / "shipped_helpers.py").write_text("WIDTH = 64\n")
    run = cell(cluster_session, "import shipped_helpers\n"
                                "where = [None] * dist.get_world_size()\n"
                                "dist.all_gather_object(where, (shipped_helpers.WIDTH, "
                                "shipped_helpers.__file__.startswith("
                                "os.environ['NBDDP_NODE_DISK'] + '/code/')))\nwhere")
    assert run.assert_ok().result() == "[(64, True), (64, True)]"


def test_a_failing_rank_on_the_second_node_keeps_the_state(cluster_session):
    rank = second_node_rank(cluster_session)
    cell(cluster_session, "kept = 'still here'").assert_ok()
    run = cell(cluster_session, """
if os.environ["SLURMD_NODENAME"] == "n2":
    raise ValueError("the second node is unhappy")
""")
    assert run.error()["ename"] == "WorkerError", run.describe()
    text = run.error_text()
    assert f"rank {rank} raised ValueError: the second node is unhappy" in text, text
    assert 'raise ValueError("the second node is unhappy")' in text, text  # the cell's line
    assert "the session's ranks are back at rest, with their state" in text, text
    assert cell(cluster_session, "kept").assert_ok().result() == "'still here'"


def test_an_interrupt_reaches_both_nodes_and_keeps_the_state(cluster_session):
    cell(cluster_session, "ticks = 0").assert_ok()
    run = cluster_session.submit("""%%ddp
import time
print("working", flush=True)
while True:
    ticks += 1
    time.sleep(0.01)
""")
    run.wait_for_output("working")
    cluster_session.km.interrupt_kernel()
    run.finish(timeout=30)
    assert run.error()["ename"] == "KeyboardInterrupt", run.describe()
    assert "the session's ranks are back at rest, with their state" in run.error_text()
    counted = cell(cluster_session, """
import torch.distributed as dist
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, ticks)
min(everyone)
""").assert_ok()
    assert int(counted.result()) >= 1  # each rank's loop ran, and its count was kept


def test_a_cell_timeout_says_where_each_node_was_and_keeps_the_state(cluster_session):
    cell(cluster_session, "waited = 'yes'").assert_ok()
    run = cell(cluster_session, """import time
import torch.distributed as dist
dist.barrier()
def nap():
    time.sleep(600)
nap()""", "--timeout 3")
    assert run.error()["ename"] == "TimeoutError", run.describe()
    text = run.error_text()
    assert "did not finish within 3 s; the session's ranks are back at rest, with their state" \
        in text, text
    where = text[text.index("where each rank was"):]
    for rank in (0, 1):  # each rank's stack and collectives, sent back from its node
        assert re.search(rf"^rank {rank}: in nap \(Cell In\[\d+\], line 6\)$", where, re.M), text
        stack = where.split(f"--- rank {rank} ---\n")[1].split("--- rank")[0]
        assert stack.startswith("Main thread") and "line 6, in nap\n    time.sleep(600)" in stack
        assert re.search(rf"^rank {rank}: has completed #\d+ \(barrier\) and is not in a "
                         "collective$", where, re.M), text
    assert cell(cluster_session, "waited").assert_ok().result() == "'yes'"


def test_a_gib_argument_reaches_both_nodes_and_a_gib_result_comes_back(cluster_session):
    cluster_session.run("import torch\nbig = torch.arange(2**28, dtype=torch.int32)"
                        ).assert_ok()  # 1 GiB, a notebook name the cell reads
    run = cell(cluster_session, """
import torch.distributed as dist
seen = torch.tensor([big[-1].item() + big.numel()])  # what each rank received (int64)
dist.all_reduce(seen)
back = big * 2
seen.item()
""", "--out back", timeout=180).assert_ok()
    assert int(run.result()) == 2 * (2**28 - 1 + 2**28), run.describe()  # both ranks
    check = cluster_session.run("back.shape[0] == 2**28 and back.dtype == torch.int32 and "
                                "bool((back == 2 * torch.arange(2**28, dtype=torch.int32))"
                                ".all())").assert_ok()
    assert check.result() == "True"
    cell(cluster_session, "del back").assert_ok()  # (the ranks' copy, kept as a name)
    cluster_session.run("del big, back").assert_ok()


MAPPED_FILE = """
import re, socket

def mapped_file(tensor):
    \"\"\"The file whose mapping holds ``tensor``'s bytes (None: plain memory).\"\"\"
    address = tensor.data_ptr()
    for line in open("/proc/self/maps"):
        span, *_, path = line.split(maxsplit=5) + [""] * (6 - len(line.split(maxsplit=5)))
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            return path.strip() or None
"""


@pytest.mark.parametrize(("route", "room"), [("filesystem", "shared memory"),
                                            ("channel", "shared memory"),
                                            ("filesystem", "local disk")])
def test_an_argument_crosses_once_per_node_into_a_folder_of_the_node(slurm_env, jobs, tmp_path,
                                                                     route, room):
    """Two nodes, two ranks each: each node's ranks map one copy of a 64 MiB argument, in
    that node's own private folder in shared memory (not the shared filesystem), and a
    64 MiB result comes back; stopping the session leaves no node folder behind. The
    payload goes through the session's folder (copied by each node), or over the
    channel (``NBDDP_SESSION_DATA=channel``: the session's folder never holds it). Where
    the nodes have no shared memory to use (``NBDDP_SHM_DIR=""``, as for a small
    ``/dev/shm``), the copy is on local disk."""
    folder = "NBDDP_NODE_SHM" if room == "shared memory" else "NBDDP_NODE_DISK"
    extra = {"NBDDP_SESSION_DATA": route}
    if room == "local disk":
        extra["NBDDP_SHM_DIR"] = ""
    kernel = Kernel(tmp_path)
    try:
        kernel.run(setup_cell(slurm_env, **extra)).assert_ok()
        run = kernel.run(START.replace("--nprocs 1", "--nprocs 2"), timeout=120).assert_ok()
        jobs.append(JOB_ID.search(run.stream_text()).group(1))
        kernel.run("import torch\nbig = torch.arange(2**24, dtype=torch.int32)").assert_ok()
        cell(kernel, MAPPED_FILE).assert_ok()
        run = cell(kernel, """
import torch.distributed as dist
import sys
here = (os.environ["SLURMD_NODENAME"], mapped_file(big), os.environ["FOLDER"],
        int(big[-1]), os.path.exists(os.path.join(sys.argv[1], "payload.pkl")))
back = big + 1
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, here)
everyone
""".replace("FOLDER", folder), "--out back", timeout=120).assert_ok()
        seen = eval(run.result())  # noqa: S307 - the ranks' own repr: [(node, file, ...)]
        by_node: dict[str, set[str]] = {}
        for node, file, node_folder, last, in_session_folder in seen:
            assert last == 2**24 - 1 and in_session_folder == (route == "filesystem"), seen
            assert file is not None and file.startswith(node_folder + "/"), seen
            by_node.setdefault(node, set()).add(file)
        assert sorted(by_node) == ["n1", "n2"], seen
        assert all(len(files) == 1 for files in by_node.values()), seen  # one copy a node
        assert by_node["n1"] != by_node["n2"], seen
        folders = {folder for _, _, folder, _, _ in seen}
        check = kernel.run("bool((back == torch.arange(1, 2**24 + 1, dtype=torch.int32)).all())"
                           ).assert_ok()
        assert check.result() == "True", check.describe()
        kernel.run("%ddp_session stop", timeout=120).assert_ok()
        wait_until(lambda: not any(Path(folder).exists() for folder in folders), timeout=30)
    finally:
        kernel.shutdown()


def test_pdb_on_the_second_nodes_rank_is_answered_in_the_notebook(cluster_session):
    rank = second_node_rank(cluster_session)
    run = cluster_session.submit("""%%ddp
x = 40 + dist.get_rank()
if os.environ["SLURMD_NODENAME"] == "n2":
    breakpoint()
dist.barrier()
x + 2
""")
    answer(run, f"[rank {rank}] (Pdb) ", "p os.environ['SLURMD_NODENAME'], x")
    answer(run, f"[rank {rank}] (Pdb) ", "c")
    run.finish(timeout=60).assert_ok()
    assert f"('n2', {40 + rank})" in run.stream_text(), run.describe()
    assert run.result() == "42"  # rank 0's value


# --- the end --------------------------------------------------------------------------


def test_a_job_cancelled_mid_cell_is_named_and_the_next_cell_waits_for_a_new_job(
        fresh_cluster_session, slurm_env, jobs):
    kernel, first_job = fresh_cluster_session
    cell(kernel, "lost = True").assert_ok()
    run = kernel.submit("%%ddp\nimport time\nprint('working', flush=True)\ntime.sleep(600)")
    run.wait_for_output("working")
    slurm(slurm_env, "scancel", first_job)  # as an administrator, or a preemption, would
    run.finish(timeout=60)
    text = run.error_text()
    assert run.error()["ename"] == "NbddpError", run.describe()
    assert f"SLURM job {first_job} was cancelled before every rank returned" in text, text
    assert "the session was restarted: variables defined in earlier cells are gone" in text
    again = cell(kernel, "'lost' in dir()", timeout=120).assert_ok()
    assert again.result() == "False"
    new_job = JOB_ID.search(again.stream_text())  # the new job's start, said in the cell
    assert new_job and new_job.group(1) != first_job, again.describe()
    jobs.append(new_job.group(1))


def test_a_rank_killed_on_the_second_node_restarts_the_session_as_a_new_job(
        fresh_cluster_session, slurm_env, jobs):
    kernel, first_job = fresh_cluster_session
    rank = second_node_rank(kernel)
    cell(kernel, "lost = True").assert_ok()
    victim = session_pids(kernel)[rank]
    run = cell(kernel, f"""
import time
if dist.get_rank() != {rank}:
    os.kill({victim}, {int(signal.SIGKILL)})
time.sleep(60)
""")
    assert run.error()["ename"] == "WorkerError", run.describe()
    text = run.error_text()
    assert f"rank {rank}" in text and "SIGKILL" in text, text
    assert "the session was restarted" in text, text
    assert job_ended(slurm_env, first_job)
    again = cell(kernel, "'lost' in dir()").assert_ok()
    assert again.result() == "False"
    status = kernel.run("%ddp_session").assert_ok().result()
    new_job = re.search(r"on SLURM job (\d+)", status).group(1)
    jobs.append(new_job)
    assert new_job != first_job


def test_a_nodes_torchrun_killed_leaves_no_data_folder_on_it(fresh_cluster_session, slurm_env,
                                                             jobs):
    """nbddp's torchrun on n2 is killed (SIGKILL: it cannot clean up) while n2 keeps a
    cell's 16 MiB payload: SLURM's task epilog removes the node's data folders anyway,
    and the session goes on with a new job."""
    kernel, job_id = fresh_cluster_session
    rank = second_node_rank(kernel)
    kernel.run("import torch\nbig = torch.ones(2**22)").assert_ok()
    cell(kernel, "int(big.sum())").assert_ok()  # each node keeps its copy until the next
    folders = glob.glob(f"{SHM}/nbddp-node-{os.getuid()}-{job_id}.*")
    assert len(folders) == 2 and all(os.listdir(folder) for folder in folders), folders
    torchrun = int(Path(f"/proc/{session_pids(kernel)[rank]}/stat").read_text()
                   .rsplit(")", 1)[1].split()[1])  # the rank's parent
    assert "nbddp._torchrun" in Path(f"/proc/{torchrun}/cmdline").read_text()
    os.kill(torchrun, signal.SIGKILL)
    wait_until(lambda: job_ended(slurm_env, job_id), timeout=60, interval=0.2)
    wait_until(lambda: not any(os.path.exists(folder) for folder in folders), timeout=30)
    again = cell(kernel, "int(big.sum())", timeout=120)
    assert again.result() == str(2**22), again.describe()
    status = kernel.run("%ddp_session").assert_ok().result()
    jobs.append(re.search(r"on SLURM job (\d+)", status).group(1))


def test_stop_ends_the_job_and_leaves_nothing(fresh_cluster_session, slurm_env):
    kernel, job_id = fresh_cluster_session
    cell(kernel, "x = 1").assert_ok()
    ranks = _snapshot(session_pids(kernel).values())  # (the nodes are this machine)
    folder = Path(kernel.run(  # the session's own folder, on the shared filesystem
        "str(get_ipython().magics_manager.registry['DDPMagics'].session._group.run_dir.path)"
    ).assert_ok().result().strip("'"))
    assert (folder / "key").exists() and (folder / "channel.address").exists()
    text = kernel.run("%ddp_session stop").assert_ok().stream_text()
    assert "stopped" in text
    assert job_ended(slurm_env, job_id)  # gone from the queue when stop returns
    assert not _alive(ranks)
    assert not [name for name in ("key", "channel.address", "payload.pkl")
                if (folder / name).exists()]  # its secrets; the job's output stays
    assert (folder / "torchrun.log").exists()


@pytest.mark.parametrize("how", ["killed", "shut down"])
def test_with_no_grace_a_kernel_that_goes_ends_its_sessions_job(slurm_env, jobs, tmp_path,
                                                                 how):
    kernel = Kernel(tmp_path)
    try:
        job_id = start_session(kernel, slurm_env, jobs, "--grace 0")
        cell(kernel, "x = 1").assert_ok()
        ranks = _snapshot(session_pids(kernel).values())
        kernel.end(how)
        wait_until(lambda: job_ended(slurm_env, job_id), timeout=60, interval=0.2)
        wait_until(lambda: not _alive(ranks), timeout=15)
    finally:
        kernel.shutdown()


def test_a_node_whose_slurmd_stops_mid_cell_ends_the_cell_naming_the_lost_node(
        fresh_cluster_session, slurm_env):
    """n2's slurmd stops answering (SIGSTOP) while a cell runs, and SLURM takes the node
    down, as slurmctld does once the node's timeout passes: the job fails, and the cell
    says so, naming the cause; the session says its state is gone. Then the node comes
    back, and its slurmd ends what was left of the job there."""
    kernel, job_id = fresh_cluster_session
    ranks = _snapshot(session_pids(kernel).values())
    slurmd = int((SLURM_DIR / "pids" / "slurmd-n2.pid").read_text())
    run = kernel.submit("%%ddp\nimport time\nprint('working', flush=True)\ntime.sleep(600)")
    run.wait_for_output("working")
    os.kill(slurmd, signal.SIGSTOP)
    try:
        slurm(slurm_env, "scontrol", "update", "NodeName=n2", "State=DOWN",
              "Reason=nbddp test: slurmd stopped")
        run.finish(timeout=60)
    finally:
        os.kill(slurmd, signal.SIGCONT)
        resume_node(slurm_env, "n2")
    text = run.error_text()
    assert run.error()["ename"] == "NbddpError", run.describe()
    assert f"SLURM job {job_id} lost a node" in text, text
    assert "the session was restarted: variables defined in earlier cells are gone" in text
    wait_until(lambda: not _alive(ranks), timeout=60)  # n2's too, once its slurmd is back
    wait_until(lambda: "idle" in slurm(slurm_env, "sinfo", "-h", "-n", "n2", "-o", "%t"),
               timeout=60, interval=0.5)
    kernel.run("%ddp_session stop").assert_ok()  # (and its replacement job)


# --- a new kernel attaches ----------------------------------------------------------


SLOW_TO_UNPACK = """
import time
def unpacked_slowly():
    print("unpacking on the ranks", flush=True)
    time.sleep(3)
class SlowToUnpack:
    def __reduce__(self):
        return (unpacked_slowly, ())
slow = SlowToUnpack()
"""


@pytest.mark.parametrize("how", ["killed", "shut down", "killed mid-cell",
                                 "killed as a cell starts"])
def test_a_new_kernel_attaches_to_the_sessions_ranks_with_their_state(
        slurm_env, jobs, tmp_path, how):
    first = Kernel(tmp_path)
    try:
        job_id = start_session(first, slurm_env, jobs)
        cell(first, "import torch.distributed as dist\nkept = [dist.get_rank()]").assert_ok()
        ranks = _snapshot(session_pids(first).values())
        if how == "killed mid-cell":  # the ranks stop that cell, and keep the state
            first.submit("%%ddp\nprint('busy', flush=True)\nwhile True:\n    pass"
                         ).wait_for_output("busy")
        elif how == "killed as a cell starts":  # they stop it as its code starts
            first.run(SLOW_TO_UNPACK).assert_ok()
            first.submit("%%ddp\nslow\nwhile True:\n    pass"
                         ).wait_for_output("unpacking on the ranks")
        first.end("killed" if how.startswith("killed") else how)
    finally:
        first.shutdown()
    assert not job_ended(slurm_env, job_id) and _alive(ranks)  # they wait for a kernel
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    second = Kernel(elsewhere)  # as a restarted kernel is: a new process (here, elsewhere)
    try:
        second.run(setup_cell(slurm_env, NBDDP_TEST_KERNEL="second")
                   + "\nkept = 'the notebook s'").assert_ok()
        run = second.run(f"%ddp_session attach {job_id}", timeout=60).assert_ok()
        assert (f"attached to the session on SLURM job {job_id} (2 ranks, 2 names kept "
                "on them)") in run.stream_text(), run.describe()
        again = cell(second, """
kept.append(dist.get_rank() + 10)
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, kept)
everyone
""").assert_ok()  # `kept` is the ranks' own, not the notebook's
        assert again.result() == "[[0, 10], [1, 11]]", again.describe()
        assert set(session_pids(second).values()) == set(ranks)  # the same processes
        where = cell(second, "os.getcwd(), os.environ.get('NBDDP_TEST_KERNEL')").assert_ok()
        assert eval(where.result()) == (str(elsewhere), "second"), where.describe()  # noqa: S307
        second.run("%ddp_session stop").assert_ok()
        assert job_ended(slurm_env, job_id)
    finally:
        second.shutdown()


# --- in Python ----------------------------------------------------------------------


def test_the_python_api_runs_on_the_nodes(slurm_env, jobs, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])

    def where() -> str:
        return os.environ["SLURMD_NODENAME"]

    def naps() -> None:
        time.sleep(600)

    with nbddp.Session(nprocs=1, cluster=nbddp.Slurm(nodes=2, cpus_per_task=1)) as session:
        jobs.append(session.status().where.split()[2])
        assert sorted(session.run_all(where)) == ["n1", "n2"]
        assert "on SLURM job" in str(session.status())
        job = session.submit(naps, stdout=io.StringIO())
        wait_until(lambda: [text.startswith(f"rank {rank}: in naps (") for rank, text in
                            job.stacks().items()] == [True] * 2,
                   timeout=30)  # on demand, from both nodes, while the run goes on
        assert job.hang_report().splitlines()[1:] == [
            "rank 0: has entered no collective yet", "rank 1: has entered no collective yet"]
        assert job.cancel()
        assert session.run(where) in ("n1", "n2")  # the ranks came back to rest
    assert session.closed
    assert job_ended(slurm_env, jobs[-1])


def test_options_a_session_job_cannot_take_are_refused(slurm_env):
    with pytest.raises(ValueError, match="does not take requeue"):
        nbddp.Session(nprocs=1, cluster=nbddp.Slurm(requeue=True))
    with pytest.raises(ValueError, match="grace is for a session on a cluster"):
        nbddp.Session(nprocs=1, grace=60)


def test_attach_names_the_session_jobs_to_choose_from(slurm_env, jobs, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
    with pytest.raises(nbddp.NbddpError, match="SLURM job 999999 is not a running session"):
        nbddp.Session.attach(999999)
    job = nbddp.Slurm(nodes=1, cpus_per_task=1)  # (beside the module's two-node session)
    with nbddp.Session(nprocs=1, cluster=job) as one, nbddp.Session(nprocs=1, cluster=job) as two:
        ids = [session.status().where.split()[2] for session in (one, two)]
        jobs.extend(ids)
        with pytest.raises(nbddp.NbddpError, match="several session jobs run") as error:
            nbddp.Session.attach()
        assert all(f"SLURM job {job_id}: 1 rank on 1 node, started" in str(error.value)
                   for job_id in ids), error.value
        monkeypatch.setattr(nbddp._slurm.backend, "ATTACH_WAIT", 3.0)
        with pytest.raises(nbddp.NbddpError, match="did not come within 3 s"):
            nbddp.Session.attach(ids[0])  # its ranks are this process's session's


NOBODY = 65534


def test_attach_takes_no_folder_that_anyone_else_made_or_can_write(slurm_env, jobs,
                                                                   monkeypatch):
    """A user who can write to the runs folder (a group's project space) plants a copy of
    a session's folder, with a key of their own: attach must not listen with it."""
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
    monkeypatch.setattr(nbddp._slurm.backend, "ATTACH_WAIT", 2.0)
    with nbddp.Session(nprocs=1, cluster=nbddp.Slurm(nodes=1, cpus_per_task=1)) as session:
        job_id = session.status().where.split()[2]
        jobs.append(job_id)
        real = session._group.run_dir.path
        planted = real.with_name(real.name + "-planted")
        shutil.copytree(real, planted, ignore=shutil.ignore_patterns("torchelastic-*"))
        try:
            with pytest.raises(nbddp.NbddpError, match="several session jobs run"):
                nbddp.Session.attach(job_id)  # (the control: a private copy is one)
            for plant in ("group may write", "someone else's key"):
                if plant == "group may write":
                    planted.chmod(0o770)
                else:
                    planted.chmod(0o700)
                    os.chown(planted / "key", NOBODY, NOBODY)
                with pytest.raises(nbddp.NbddpError, match="did not come within 2 s"):
                    nbddp.Session.attach(job_id)  # the real folder alone: its ranks are ours
        finally:
            shutil.rmtree(planted)
        assert sorted(session.run_all(_rank_sum)) == [0.0]


def test_another_user_cannot_read_the_key_or_move_the_address(slurm_env, jobs, monkeypatch,
                                                              tmp_path_factory):
    """On a shared filesystem whose folders anyone may pass through, the session's folder
    keeps its key and the kernel's address to their owner: another user can neither
    read the key (to attach) nor replace the address (to lure the ranks)."""
    shared = Path(tempfile.mkdtemp(prefix="nbddp-shared-", dir="/var/tmp"))
    try:
        shared.chmod(0o755)
        monkeypatch.setenv("NBDDP_RUNS_DIR", str(shared / "runs"))
        monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
        with nbddp.Session(nprocs=1, cluster=nbddp.Slurm(nodes=2, cpus_per_task=1)) as session:
            jobs.append(session.status().where.split()[2])
            folder = session._group.run_dir.path
            assert (folder.stat().st_mode & 0o777, (folder / "key").stat().st_mode & 0o777,
                    (folder / "channel.address").stat().st_mode & 0o777) == (0o700, 0o600, 0o600)
            attempt = subprocess.run(
                ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh",
                 "-c", 'cat "$0/key"; echo "127.0.0.1 1" > "$0/channel.address"', str(folder)],
                capture_output=True, text=True, timeout=30)
            assert attempt.stderr.count("Permission denied") == 2, attempt.stderr
            assert session.run(_rank_sum) == 1.0  # the ranks still answer this kernel
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _rank_sum() -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return float(value.item())


# --- a kernel inside an allocation --------------------------------------------------


def test_a_kernel_inside_an_allocation_runs_the_session_as_a_job_step(slurm_env, jobs,
                                                                      tmp_path):
    """As a kernel that ``salloc``'s shell (or a batch job's Jupyter) started: the session
    uses the allocation's nodes with ``srun``, submits nothing, and outlives the kernel
    for another to attach; stopping it ends the step, not the allocation."""
    granted = subprocess.run(["salloc", "--no-shell", "--nodes=2", "--ntasks-per-node=1",
                              "--time=10"], env=slurm_env, capture_output=True, text=True,
                             timeout=120)
    allocation = re.search(r"Granted job allocation (\d+)", granted.stderr).group(1)
    jobs.append(allocation)
    inside = {**slurm_env, "SLURM_JOB_ID": allocation, "SLURM_JOB_NUM_NODES": "2",
              "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODELIST": "n[1-2]"}
    first = Kernel(tmp_path, env=inside)
    try:
        first.run(setup_cell(slurm_env)).assert_ok()
        run = first.run("%ddp_session start --slurm --nprocs 1", timeout=120).assert_ok()
        assert f"job step of SLURM allocation {allocation} (n[1-2])" in run.stream_text()
        assert "submitted" not in run.stream_text() and "queued" not in run.stream_text()
        where = cell(first, """
import torch.distributed as dist
mine = (os.environ["SLURMD_NODENAME"], os.environ["SLURM_JOB_ID"], "SLURM_STEP_ID" in os.environ)
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, mine)
sorted(everyone)
""").assert_ok()
        assert where.result() == str([("n1", allocation, True), ("n2", allocation, True)])
        first.end("killed")
    finally:
        first.shutdown()
    second = Kernel(tmp_path, env=inside)
    try:
        second.run(setup_cell(slurm_env)).assert_ok()
        second.run("%ddp_session attach", timeout=60).assert_ok()  # the one session running
        assert cell(second, "mine[0]").assert_ok().result() in ("'n1'", "'n2'")
        second.run("%ddp_session stop").assert_ok()
    finally:
        second.shutdown()
    steps = slurm(slurm_env, "squeue", "--steps", "--noheader", f"--jobs={allocation}",
                  "--format=%j")
    assert "nbddp-session" not in steps, steps  # the step ended with the session
    assert not job_ended(slurm_env, allocation)  # and the allocation stays the user's
