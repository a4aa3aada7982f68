"""Cluster sessions whose nodes each run several ranks: the ranks speak to the kernel through
their node's relay (``_rank.relay``, in the node's torchrun), on the two-node Ray and
SLURM test clusters, through a real kernel. What a user checks: the state kept, the
kernel's mean over every rank's metric, a rank's error named with its traceback, stacks
from every rank, tensors to the ranks and back over the channel (through the relays), an
interrupt that reaches every rank, a killed rank named (the session starts again), and a
node whose torchrun (its relay) is killed said to be lost, nothing left."""

from __future__ import annotations

import contextlib
import re
import signal
import time
from pathlib import Path

import pytest

from nbddp._run.config import RELAY_FROM_PER_NODE
from nbddp._wire.rundir import parse_address

from .conftest import wait_until
from .kernel_driver import Kernel
from .slurm import job_ended
from .test_ray_session import (
    MAPPED_FROM,
    ray_cluster,  # noqa: F401 - the module's own cluster
)
from .test_ray_session import setup_cell as ray_setup_cell
from .test_slurm_session import session_jobs, start_session  # noqa: F401 - fixture

pytestmark = [pytest.mark.slow, pytest.mark.waits]

PER_NODE = RELAY_FROM_PER_NODE  # (the fewest ranks a node has a relay for)
RAY_START = f"%ddp_session start --ray --nodes 2 --nprocs {PER_NODE}"

SESSION = "import os\n_session = get_ipython().magics_manager.registry['DDPMagics'].session"

RELAYS = """
_session.run_all(lambda: (os.environ.get('NBDDP_RELAY'), os.getppid()))
"""

LOG_STEPS = """
def log_steps(steps):
    import torch.distributed as dist
    import nbddp
    for step in range(steps):
        nbddp.log(step=step, loss=dist.get_rank() * 10.0 + step)

_job = _session.submit(log_steps, (20,))
_job.result(timeout=120)
[(row['step'], row['ranks'], row['loss']) for row in _job.history]
"""

DATA_BOTH_WAYS = """
import torch
os.environ['NBDDP_SESSION_DATA'] = 'channel'  # (each node's copy over the channel)
try:
    _big = torch.arange(2**22, dtype=torch.float32)
    def _checked(t):
        import torch.distributed as dist
        return float(t[-1]) + dist.get_rank()
    _seen = _session.run_all(_checked, _big)
    _back = _session.run(lambda: torch.full((2**22,), 2.0))
finally:
    del os.environ['NBDDP_SESSION_DATA']
_seen, float(_back.sum())
"""

FREED_FROM_THE_STORE = """
import time, torch, ray
def _held():  # (the objects the kernel holds a reference to, as `ray memory` lists them)
    return set(ray._private.worker.global_worker.core_worker.get_all_reference_counts())
_before = _held()
_firsts = [_session.run(lambda t: float(t[0]), torch.full((2**22,), float(cell)))
           for cell in range(4)]
_deadline = time.monotonic() + 30
while _held() - _before and time.monotonic() < _deadline:
    time.sleep(0.2)
_firsts, len(_held() - _before)
"""

ONCE_PER_NODE = """
import torch
_big = torch.arange(2**22, dtype=torch.float32)
def _mapped(t):
    import os
    device, inode, path = mapping_of(t)
    return (int(os.environ['GROUP_RANK']), device, inode,
            os.path.basename(os.path.dirname(path))[:11], float(t[-1]))
_session.run_all(_mapped, _big)
"""


def cell(kernel: Kernel, body: str, options: str = "", timeout: float = 90):
    return kernel.run(f"%%ddp {options}\n{body}", timeout=timeout)


def relays_of(kernel: Kernel) -> list[tuple[str | None, int]]:
    return eval(kernel.run(RELAYS).assert_ok().result())  # noqa: S307 - our own repr


def kernel_connections(kernel: Kernel) -> int:
    """How many connections the kernel's channel holds now (the nodes are this machine:
    its TCP table has the kernel's end of each), at the port in the session's folder."""
    folder = Path(kernel.run("str(_session._group.run_dir.path)").assert_ok().result()
                  .strip("'"))
    _, port = parse_address((folder / "channel.address").read_text())
    held = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            held += int(local.rsplit(":", 1)[1], 16) == port and state == "01"  # ESTABLISHED
    return held


def check_every_rank_speaks_through_its_node_s_relay(kernel: Kernel) -> None:
    relays = relays_of(kernel)
    assert len(relays) == 2 * PER_NODE
    sockets = {path for path, _ in relays}
    assert None not in sockets and len(sockets) == 2, relays  # one relay per node
    by_node = {}
    for path, parent in relays:
        by_node.setdefault(path, set()).add(parent)
    assert all(len(parents) == 1 for parents in by_node.values())  # (the node's torchrun)
    cell(kernel, "import torch, torch.distributed as dist\n"
                 "total = torch.ones(2) * (dist.get_rank() + 1)\n"
                 "dist.all_reduce(total)").assert_ok()
    ranks = 2 * PER_NODE
    assert cell(kernel, "total.sum().item()").assert_ok().result() == \
        str(2.0 * sum(rank + 1 for rank in range(ranks)))


def check_metrics_exact(kernel: Kernel) -> None:
    rows = eval(kernel.run(LOG_STEPS, timeout=180).assert_ok().result())  # noqa: S307
    ranks = 2 * PER_NODE
    assert [step for step, _, _ in rows] == list(range(20))
    for step, heard, loss in rows:
        assert heard == ranks
        assert loss == pytest.approx(sum(r * 10.0 + step for r in range(ranks)) / ranks)


def check_a_failing_rank_is_named_with_its_traceback(kernel: Kernel) -> None:
    run = cell(kernel, "kept = 41\n"
                       "dist.barrier()\n"  # (every rank has kept it before rank 3 fails)
                       "def bad_batch():\n    raise ValueError('bad batch on rank 3')\n"
                       "if dist.get_rank() == 3:\n    bad_batch()")
    error = run.error()
    assert error is not None and error["ename"] == "WorkerError", run.describe()
    assert "rank 3" in error["evalue"] and "bad batch on rank 3" in run.describe()
    assert "bad_batch" in run.describe()  # (its traceback, through the relay)
    assert cell(kernel, "kept + 1").assert_ok().result() == "42"


def check_stacks_come_from_every_rank(kernel: Kernel) -> None:
    run = cell(kernel, "import time\n"
                       "def wait_here():\n    time.sleep(60)\n"
                       "wait_here()", options="--timeout 5", timeout=120)
    text = run.error_text()
    assert run.error()["ename"] == "TimeoutError", run.describe()
    for rank in range(2 * PER_NODE):
        assert re.search(rf"rank {rank}\b.*wait_here", text), text


def check_data_crosses_the_relays_both_ways(kernel: Kernel) -> None:
    run = kernel.run(DATA_BOTH_WAYS, timeout=300).assert_ok()
    seen, back = eval(run.result())  # noqa: S307 - our own repr
    assert seen == [2.0**22 - 1 + rank for rank in range(2 * PER_NODE)]
    assert back == 2.0 * 2**22


def check_an_interrupt_reaches_every_rank_and_keeps_the_state(kernel: Kernel) -> None:
    cell(kernel, "ticks = 0").assert_ok()
    run = kernel.submit("%%ddp\nimport time\nprint('working', flush=True)\n"
                        "while True:\n    ticks += 1\n    time.sleep(0.01)")
    run.wait_for_output("working")
    time.sleep(1)  # (every rank is in its loop)
    kernel.km.interrupt_kernel()
    run.finish(timeout=60)
    assert run.error()["ename"] == "KeyboardInterrupt", run.describe()
    assert "back at rest, with their state" in run.error_text(), run.describe()
    ticks = eval(cell(kernel, "import torch.distributed as dist\n"  # noqa: S307
                              "everyone = [None] * dist.get_world_size()\n"
                              "dist.all_gather_object(everyone, ticks)\n"
                              "everyone").assert_ok().result())
    assert len(ticks) == 2 * PER_NODE and min(ticks) >= 1, ticks


def kill_a_rank_on_the_second_node(kernel: Kernel) -> str:
    """SIGKILL the last rank (on the second node, behind its relay) mid-cell, from a rank
    on the first: the cell names it and says the state is gone; the next cell runs on
    new ranks, through relays again. The cell's error text."""
    kernel.run("lost = True").assert_ok()
    relays = relays_of(kernel)
    pids = eval(kernel.run("_session.run_all(os.getpid)").assert_ok().result())  # noqa: S307
    victim = len(pids) - 1
    run = cell(kernel, f"import os, signal, time, torch.distributed as dist\n"
                       f"if dist.get_rank() == 0:\n"
                       f"    time.sleep(1)\n    os.kill({pids[victim]}, {int(signal.SIGKILL)})\n"
                       f"time.sleep(60)", timeout=120)
    text = run.error_text()
    assert run.error() is not None, run.describe()
    assert re.search(rf"rank {victim}\b", text), text
    assert relays[victim][1] != relays[0][1]  # (the victim was behind the other relay)
    assert cell(kernel, "'lost' in dir()", timeout=180).assert_ok().result() == "False"
    check_every_rank_speaks_through_its_node_s_relay(kernel)
    return text


def kill_the_second_node_s_torchrun(kernel: Kernel) -> None:
    """SIGKILL the torchrun (and so the relay) of the last rank's node, mid-cell: the
    cell names one of that node's ranks as lost with its node."""
    relays = relays_of(kernel)
    victim = relays[-1][1]
    lost = {rank for rank, (_, parent) in enumerate(relays) if parent == victim}
    assert "nbddp._torchrun" in Path(f"/proc/{victim}/cmdline").read_text()
    killer = min(set(range(len(relays))) - lost)
    run = kernel.submit(f"%%ddp\nimport os, signal, time, torch.distributed as dist\n"
                        f"if dist.get_rank() == {killer}:\n"
                        f"    time.sleep(1)\n    os.kill({victim}, {int(signal.SIGKILL)})\n"
                        f"time.sleep(60)")
    run.finish(timeout=90)
    text = run.error_text()
    assert run.error() is not None, run.describe()
    named = re.search(r"rank (\d+) was lost with its node", text)
    assert named and int(named.group(1)) in lost, text


# --- Ray ----------------------------------------------------------------------------


@contextlib.contextmanager
def ray_session(ray_cluster, folder: Path, first: str = "pass"):  # noqa: F811
    """A kernel with a Ray session of relayed nodes (``first``: a cell before it starts);
    once it is stopped, nothing of it is left on the cluster."""
    kernel = Kernel(folder)
    try:
        kernel.run(first).assert_ok()
        kernel.run(ray_setup_cell(ray_cluster)).assert_ok()
        kernel.run(RAY_START, timeout=180).assert_ok()
        kernel.run(SESSION).assert_ok()
        yield kernel
        kernel.run("%ddp_session stop").assert_ok()
    finally:
        kernel.shutdown()
    assert ray_cluster.wait_empty() == {"actors": [], "placement_groups": []}


@pytest.fixture(scope="module")
def ray_relayed(ray_cluster, tmp_path_factory):  # noqa: F811
    with ray_session(ray_cluster, tmp_path_factory.mktemp("ray-relay")) as kernel:
        yield kernel


@pytest.mark.ray
def test_ray_every_rank_speaks_through_its_node_s_relay(ray_relayed):
    check_every_rank_speaks_through_its_node_s_relay(ray_relayed)


@pytest.mark.ray
def test_ray_the_kernel_s_mean_is_over_every_rank(ray_relayed):
    check_metrics_exact(ray_relayed)


@pytest.mark.ray
def test_ray_a_failing_rank_is_named_with_its_traceback(ray_relayed):
    check_a_failing_rank_is_named_with_its_traceback(ray_relayed)


@pytest.mark.ray
def test_ray_stacks_come_from_every_rank(ray_relayed):
    check_stacks_come_from_every_rank(ray_relayed)


@pytest.mark.ray
def test_ray_tensors_cross_the_relays_both_ways(ray_relayed):
    check_data_crosses_the_relays_both_ways(ray_relayed)


@pytest.mark.ray
def test_ray_an_argument_crosses_once_per_node_through_the_object_store(ray_relayed):
    """Ray's object store route (the default): each node's agent writes the argument into
    the node's shared memory once, and every rank of that node maps that one file (the
    same inode), a file of its own node's (another inode on the other node)."""
    ray_relayed.run(MAPPED_FROM).assert_ok()
    run = ray_relayed.run(ONCE_PER_NODE, timeout=300).assert_ok()
    mapped = eval(run.result())  # noqa: S307 - our own repr
    assert [value for *_, value in mapped] == [2.0**22 - 1] * (2 * PER_NODE)
    files = {node: {(device, inode) for n, device, inode, _, _ in mapped if n == node}
             for node in (0, 1)}
    assert all(len(on_node) == 1 for on_node in files.values()), mapped  # once a node
    assert files[0] != files[1], mapped  # each node its own copy
    assert {folder for *_, folder, _ in mapped} == {"nbddp-node-"}, mapped
    assert [node for node, *_ in mapped] == [rank // PER_NODE for rank in range(2 * PER_NODE)]


@pytest.mark.ray
def test_ray_each_cell_s_argument_leaves_the_object_store_once_every_node_has_it(
        ray_relayed):
    """Four cells, each with a 16 MiB argument through Ray's object store: once the
    cells have run, the kernel holds a reference to none of them (``ray memory``'s
    table), so Ray frees each and a long session does not fill the store."""
    run = ray_relayed.run(FREED_FROM_THE_STORE, timeout=300).assert_ok()
    firsts, still_held = eval(run.result())  # noqa: S307 - our own repr
    assert firsts == [0.0, 1.0, 2.0, 3.0]
    assert still_held == 0, f"the kernel still holds {still_held} objects of the cells"


@pytest.mark.ray
def test_ray_an_interrupt_reaches_every_rank_and_keeps_the_state(ray_relayed):
    check_an_interrupt_reaches_every_rank_and_keeps_the_state(ray_relayed)


@pytest.mark.ray
def test_ray_a_killed_rank_starts_the_session_again_and_a_killed_relay_is_the_node_lost(
        ray_relayed):
    """(Last of the Ray tests: the session's state is gone after it, and its ranks are
    new ones. It is stopped here, and its fixture checks that nothing of it is left on
    the cluster.)"""
    text = kill_a_rank_on_the_second_node(ray_relayed)
    assert "variables defined in earlier cells are gone" in text, text
    kill_the_second_node_s_torchrun(ray_relayed)
    ray_relayed.run("%ddp_session stop", timeout=120).assert_ok()


# --- SLURM --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm_relayed(slurm_env, session_jobs, tmp_path_factory):  # noqa: F811
    kernel = Kernel(tmp_path_factory.mktemp("slurm-relay"))
    try:
        start_session(kernel, slurm_env, session_jobs, f"--nprocs {PER_NODE}")
        kernel.run(SESSION).assert_ok()
        yield kernel
        kernel.run("%ddp_session stop").assert_ok()
    finally:
        kernel.shutdown()


@pytest.mark.slurm
def test_slurm_every_rank_speaks_through_its_node_s_relay(slurm_relayed):
    check_every_rank_speaks_through_its_node_s_relay(slurm_relayed)


@pytest.mark.slurm
def test_slurm_the_kernel_s_mean_is_over_every_rank(slurm_relayed):
    check_metrics_exact(slurm_relayed)


@pytest.mark.slurm
def test_slurm_a_failing_rank_is_named_with_its_traceback(slurm_relayed):
    check_a_failing_rank_is_named_with_its_traceback(slurm_relayed)


@pytest.mark.slurm
def test_slurm_tensors_cross_the_relays_both_ways(slurm_relayed):
    check_data_crosses_the_relays_both_ways(slurm_relayed)


@pytest.mark.slurm
def test_slurm_an_interrupt_reaches_every_rank_and_keeps_the_state(slurm_relayed):
    check_an_interrupt_reaches_every_rank_and_keeps_the_state(slurm_relayed)


@pytest.mark.slurm
def test_slurm_a_killed_rank_or_relay_ends_the_job_and_the_next_cell_runs_anew(
        slurm_relayed, slurm_env, session_jobs):  # noqa: F811
    """(Last of the module session's tests: each kill starts the session anew as a new
    job, and the session is stopped here.)"""
    text = kill_a_rank_on_the_second_node(slurm_relayed)
    assert "SIGKILL" in text and "the session was restarted" in text, text
    status = slurm_relayed.run("%ddp_session").assert_ok().result()
    job_id = re.search(r"on SLURM job (\d+)", status).group(1)
    session_jobs.append(job_id)
    kill_the_second_node_s_torchrun(slurm_relayed)
    wait_until(lambda: job_ended(slurm_env, job_id), timeout=60, interval=0.2)
    assert cell(slurm_relayed, "import torch.distributed as dist\ndist.get_world_size()",
                timeout=180).assert_ok().result() == str(2 * PER_NODE)
    check_every_rank_speaks_through_its_node_s_relay(slurm_relayed)  # (the new job's)
    status = slurm_relayed.run("%ddp_session").assert_ok().result()
    session_jobs.append(re.search(r"on SLURM job (\d+)", status).group(1))
    slurm_relayed.run("%ddp_session stop", timeout=120).assert_ok()  # (last: nothing left)


@pytest.mark.slurm
def test_slurm_a_new_kernel_attaches_to_relayed_ranks_with_their_state(slurm_env, jobs,
                                                                       tmp_path):
    """The first kernel is killed; its relays close their ranks' links with it, connect to
    the kernel that attaches, and the ranks, with their state, speak to it through them
    again: the new kernel holds one connection per node, as the first did."""
    from .test_kernel import _alive, _snapshot
    from .test_slurm_session import session_pids
    from .test_slurm_submit import setup_cell

    first = Kernel(tmp_path)
    try:
        job_id = start_session(first, slurm_env, jobs, f"--nprocs {PER_NODE}")
        first.run(SESSION).assert_ok()
        assert None not in {path for path, _ in relays_of(first)}
        assert kernel_connections(first) == 2
        cell(first, "import torch.distributed as dist\nkept = [dist.get_rank()]").assert_ok()
        ranks = _snapshot(session_pids(first).values())
        first.end("killed")
    finally:
        first.shutdown()
    assert not job_ended(slurm_env, job_id) and _alive(ranks)  # they wait for a kernel
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    second = Kernel(elsewhere)
    try:
        second.run(setup_cell(slurm_env)).assert_ok()
        second.run(f"%ddp_session attach {job_id}", timeout=60).assert_ok()
        again = cell(second, "kept.append(dist.get_rank() + 10)\n"
                             "everyone = [None] * dist.get_world_size()\n"
                             "dist.all_gather_object(everyone, kept)\n"
                             "everyone").assert_ok()
        assert eval(again.result()) == [[r, r + 10] for r in range(2 * PER_NODE)]  # noqa: S307
        assert set(session_pids(second).values()) == set(ranks)  # the same processes
        second.run(SESSION).assert_ok()
        assert kernel_connections(second) == 2  # (a node's relay each, not a rank's link)
        second.run("%ddp_session stop").assert_ok()
        wait_until(lambda: job_ended(slurm_env, job_id), timeout=60, interval=0.2)
    finally:
        second.shutdown()


# --- a tree of relays (``_wire.relay_tree``: formed from two nodes here) -----------------

TREE = "import os\nos.environ['NBDDP_RELAY_TREE_FROM'] = '2'  # (a tree of the two nodes)"


def check_the_kernel_speaks_to_the_group_s_head_alone(kernel: Kernel) -> None:
    """Each node has its relay, and the kernel one connection: the group's head's (the
    other node's relay speaks through it)."""
    check_every_rank_speaks_through_its_node_s_relay(kernel)
    assert kernel_connections(kernel) == 1


def check_a_killed_relay_in_a_tree_loses_the_state_and_the_next_cell_runs(
        kernel: Kernel) -> None:
    """SIGKILL a node's torchrun (its relay: the head, or the relay behind it) mid-cell:
    the cell says a rank was lost with its node; the next cell runs on new ranks, in a
    tree again."""
    relays = relays_of(kernel)
    victim = relays[-1][1]
    killer = min(rank for rank, (_, parent) in enumerate(relays) if parent != victim)
    run = kernel.submit(f"%%ddp\nimport os, signal, time, torch.distributed as dist\n"
                        f"if dist.get_rank() == {killer}:\n"
                        f"    time.sleep(1)\n    os.kill({victim}, {int(signal.SIGKILL)})\n"
                        f"time.sleep(60)")
    run.finish(timeout=90)
    assert run.error() is not None, run.describe()
    assert re.search(r"rank \d+ was lost with its node", run.error_text()), run.describe()
    assert cell(kernel, "'kept' in dir()", timeout=180).assert_ok().result() == "False"
    check_the_kernel_speaks_to_the_group_s_head_alone(kernel)


@pytest.fixture(scope="module")
def ray_tree(ray_cluster, tmp_path_factory):  # noqa: F811
    """(The test cluster has room for one session at a time: this one starts after the
    last test of ``ray_relayed``'s has stopped that one.)"""
    with ray_session(ray_cluster, tmp_path_factory.mktemp("ray-tree"), TREE) as kernel:
        yield kernel


@pytest.mark.ray
def test_ray_a_tree_of_relays_keeps_the_state_the_exact_mean_errors_data_and_interrupts(
        ray_tree):
    check_the_kernel_speaks_to_the_group_s_head_alone(ray_tree)
    check_metrics_exact(ray_tree)
    check_a_failing_rank_is_named_with_its_traceback(ray_tree)
    check_data_crosses_the_relays_both_ways(ray_tree)
    check_an_interrupt_reaches_every_rank_and_keeps_the_state(ray_tree)
    check_stacks_come_from_every_rank(ray_tree)  # (a timeout's)


@pytest.mark.ray
def test_ray_a_killed_relay_in_a_tree_is_a_node_lost_and_the_next_cell_runs(ray_tree):
    check_a_killed_relay_in_a_tree_loses_the_state_and_the_next_cell_runs(ray_tree)
    ray_tree.run("%ddp_session stop", timeout=120).assert_ok()


@pytest.mark.slurm
def test_slurm_a_tree_of_relays_keeps_the_state_the_exact_mean_errors_data_and_interrupts(
        slurm_env, session_jobs, tmp_path):  # noqa: F811
    kernel = Kernel(tmp_path)
    try:
        kernel.run(TREE).assert_ok()
        job_id = start_session(kernel, slurm_env, session_jobs, f"--nprocs {PER_NODE}")
        kernel.run(SESSION).assert_ok()
        check_the_kernel_speaks_to_the_group_s_head_alone(kernel)
        check_metrics_exact(kernel)
        check_a_failing_rank_is_named_with_its_traceback(kernel)
        check_data_crosses_the_relays_both_ways(kernel)
        check_an_interrupt_reaches_every_rank_and_keeps_the_state(kernel)
        check_stacks_come_from_every_rank(kernel)  # (a timeout's)
        check_a_killed_relay_in_a_tree_loses_the_state_and_the_next_cell_runs(kernel)
        wait_until(lambda: job_ended(slurm_env, job_id), timeout=60, interval=0.2)
        status = kernel.run("%ddp_session").assert_ok().result()
        session_jobs.append(re.search(r"on SLURM job (\d+)", status).group(1))
        kernel.run("%ddp_session stop", timeout=120).assert_ok()
    finally:
        kernel.shutdown()
