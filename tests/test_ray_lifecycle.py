"""A Ray session's life and its failures on a real two-node Ray cluster, through real
kernels: a launch, a rank killed, an agent killed, a node lost, a kernel that dies with
and without ``grace``. Each test has the cluster to itself (its own session needs both
nodes' CPUs), and checks that nothing of it is left: no actor, placement group, process
or file.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import wait_until
from .kernel_driver import Execution, Kernel
from .ray_cluster import RayCluster
from .test_ray_session import START, cell, setup_cell
from .test_ray_session import ray_cluster as ray_cluster  # noqa: F401 - this module's own

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.waits]


@contextlib.contextmanager
def ray_kernel(cluster: RayCluster, path: Path, start: str | None = START
               ) -> Iterator[tuple[Kernel, Execution | None]]:
    """A kernel pointed at ``cluster`` with nbddp loaded, shut down at the end; with a
    session started by ``start`` (and that cell's execution), unless None."""
    kernel = Kernel(path)
    try:
        kernel.run(setup_cell(cluster)).assert_ok()
        started = kernel.run(start, timeout=180).assert_ok() if start else None
        yield kernel, started
    finally:
        kernel.shutdown()


@contextlib.contextmanager
def dying_kernel(cluster: RayCluster, path: Path) -> Iterator[Kernel]:
    """A kernel pointed at ``cluster`` with nbddp loaded, killed at the end, as a kernel
    that dies (``path`` is made for it)."""
    path.mkdir(exist_ok=True)
    kernel = Kernel(path)
    try:
        kernel.run(setup_cell(cluster)).assert_ok()
        yield kernel
    finally:
        kernel.end("killed")
        kernel.shutdown()


def test_a_launch_runs_on_both_nodes_and_leaves_nothing(ray_cluster, tmp_path):
    with ray_kernel(ray_cluster, tmp_path, start=None) as (kernel, _):
        run = kernel.run("""
def total(n):
    import torch, torch.distributed as dist
    x = torch.tensor([float(n + dist.get_rank())])
    dist.all_reduce(x)
    return x.item(), os.environ["NBDDP_NODE_NAME"]
nbddp.launch(total, nprocs=1, args=(10,), cluster=nbddp.Ray(nodes=2), all_ranks=True)
""", timeout=180).assert_ok()
        values = eval(run.result())  # noqa: S307 - our own repr
        assert [value for value, _ in values] == [21.0, 21.0]
        assert values[0][1] != values[1][1], "one rank on each node"
        assert ray_cluster.wait_empty() == {"actors": [], "placement_groups": []}


def test_a_rank_killed_restarts_the_session_and_says_so(ray_cluster, tmp_path):
    with ray_kernel(ray_cluster, tmp_path) as (kernel, _):
        cell(kernel, "lost = 1").assert_ok()
        pids = eval(kernel.run("_status = %ddp_session\n_status.pids")  # noqa: S307
                    .assert_ok().result())
        run = kernel.submit("%%ddp\nimport time\nprint('sleeping', flush=True)\n"
                            "time.sleep(30)")
        run.wait_for_output("sleeping")
        os.kill(pids[1], signal.SIGKILL)
        run.finish(timeout=120)
        assert run.error() is not None, run.describe()
        assert "rank 1" in run.describe()
        assert "variables defined in earlier cells are gone" in run.describe()
        after = cell(kernel, "'lost' in globals()").assert_ok()
        assert after.result() == "False"
        kernel.run("%ddp_session stop").assert_ok()
        assert ray_cluster.wait_empty() == {"actors": [], "placement_groups": []}


def test_an_agent_killed_mid_cell_names_the_node_and_the_cause(ray_cluster, tmp_path):
    with ray_kernel(ray_cluster, tmp_path) as (kernel, start):
        session = re.search(r"Ray session (ray-[0-9a-f]+)", start.stream_text()).group(1)
        run = kernel.submit("%%ddp\nimport time\nprint('sleeping', flush=True)\n"
                            "time.sleep(60)")
        run.wait_for_output("sleeping")
        killer = (f"import ray\nray.init(address={ray_cluster.address!r}, "
                  "log_to_driver=False)\n"
                  f"ray.kill(ray.get_actor('nbddp-{session}-agent-1', namespace='nbddp'))")
        subprocess.run([sys.executable, "-c", killer], check=True, timeout=120,
                       env=ray_cluster.env, capture_output=True)
        began = time.monotonic()
        run.finish(timeout=120)
        assert time.monotonic() - began < 30
        assert run.error() is not None, run.describe()
        text = run.error_text()
        assert re.search(r"the nbddp agent of Ray node \S+ died \(killed with ray.kill",
                         text), run.describe()
        assert "variables defined in earlier cells are gone" in text, text
        kernel.run("%ddp_session stop").assert_ok()
        assert ray_cluster.wait_empty() == {"actors": [], "placement_groups": []}


def test_a_placement_group_removed_from_outside_names_the_cause(ray_cluster, tmp_path):
    """Someone removes the session's placement group (``ray.util.remove_placement_group``,
    or a cluster admin's script) while a cell runs: the cell ends within seconds saying
    so, the state is said to be gone, and nothing of the session is left."""
    with ray_kernel(ray_cluster, tmp_path) as (kernel, _):
        run = kernel.submit("%%ddp\nimport time\nprint('sleeping', flush=True)\n"
                            "time.sleep(60)")
        run.wait_for_output("sleeping")
        ray_cluster.remove_sessions()
        began = time.monotonic()
        run.finish(timeout=120)
        assert time.monotonic() - began < 30
        assert run.error() is not None, run.describe()
        text = run.error_text()
        assert "the session's Ray placement group was removed from outside " \
            "(remove_placement_group)" in text, run.describe()
        assert "variables defined in earlier cells are gone" in text, text
        kernel.run("%ddp_session stop").assert_ok()
        assert ray_cluster.wait_empty() == {"actors": [], "placement_groups": []}


FAILS = """
def fails():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("bad shard")
    dist.barrier()
nbddp.launch(fails, nprocs=1, cluster=nbddp.Ray(nodes=2))
"""

SLEEPS = """
def sleeps():
    import time
    print("sleeping", flush=True)
    time.sleep(120)
nbddp.launch(sleeps, nprocs=1, cluster=nbddp.Ray(nodes=2))
"""


def test_a_launch_that_fails_or_is_interrupted_leaves_nothing(ray_cluster, tmp_path):
    with ray_kernel(ray_cluster, tmp_path, start=None) as (kernel, _):
        failed = kernel.run(FAILS, timeout=180)
        assert failed.error() is not None and failed.error()["ename"] == "WorkerError", \
            failed.describe()
        assert "rank 1 raised ValueError: bad shard" in failed.error_text()
        assert ray_cluster.wait_empty() == {"actors": [], "placement_groups": []}
        run = kernel.submit(SLEEPS)
        run.wait_for_output("sleeping", timeout=180)
        kernel.km.interrupt_kernel()
        run.finish(timeout=120)
        assert run.error() is not None and run.error()["ename"] == "KeyboardInterrupt", \
            run.describe()
        assert ray_cluster.wait_empty() == {"actors": [], "placement_groups": []}


def test_a_kernel_that_dies_leaves_nothing_without_grace(ray_cluster, tmp_path):
    with dying_kernel(ray_cluster, tmp_path) as kernel:
        kernel.run(START, timeout=180).assert_ok()
        assert ray_cluster.state()["placement_groups"]
    assert ray_cluster.wait_empty() == {"actors": [], "placement_groups": []}


def test_a_ddp_cell_on_ray_that_hangs_in_a_collective_says_who_waits_for_whom(ray_cluster,
                                                                          tmp_path):
    """``%%ddp --ray``, a one-off run on the cluster ``--address`` names: rank 0 waits in a
    barrier that rank 1, on the other node, never enters; the timeout's report says so,
    and nothing is left."""
    with ray_kernel(ray_cluster, tmp_path, start=None) as (kernel, _):
        kernel.run("del os.environ['RAY_ADDRESS']").assert_ok()  # (the option's alone)
        # (30 s: the ranks are in the barrier by then, even on a busy machine)
        run = kernel.run(f"%%ddp --ray --nodes 2 --nprocs 1 --address {ray_cluster.address} "
                         "--timeout 30\n"
                         "import time, torch.distributed as dist\n"
                         "if dist.get_rank() == 0:\n    dist.barrier()\n"
                         "else:\n    time.sleep(120)", timeout=240)
        assert run.error() is not None and run.error()["ename"] == "TimeoutError", \
            run.describe()
        text = run.error_text()
        assert "rank 0: waiting in barrier" in text, text
        assert re.search(r"barrier #\d+ waits for rank 1", text), text
        assert ray_cluster.wait_empty() == {"actors": [], "placement_groups": []}


PLACEMENT = """
import ray
[(g["strategy"], g["bundles"]) for g in ray.util.placement_group_table().values()
 if g["name"].startswith("nbddp-") and g["state"] != "REMOVED"]
"""


def test_the_python_api_places_attaches_and_closes(ray_cluster, tmp_path):
    """``nbddp.Session(cluster=nbddp.Ray(...))``: one placement group of a bundle per
    node, spread over distinct nodes; ``Session.attach()`` in a new kernel (with
    ``grace``) finds its state; ``close`` leaves nothing."""
    with dying_kernel(ray_cluster, tmp_path / "first") as first:
        first.run("s = nbddp.Session(nprocs=1, cluster=nbddp.Ray(nodes=2, grace=120))\n"
                  "s.run(lambda: globals().update(kept=41))", timeout=180).assert_ok()
        session_id = eval(first.run("nbddp.last_job().cluster_job_id").result())  # noqa: S307
        assert session_id.startswith("ray-"), session_id
        placed = first.run(PLACEMENT, timeout=60).assert_ok().result()
        assert eval(placed) == [("STRICT_SPREAD", {0: {"CPU": 1.0}, 1: {"CPU": 1.0}})]  # noqa: S307
    (tmp_path / "second").mkdir()
    try:
        with ray_kernel(ray_cluster, tmp_path / "second", start=None) as (second, _):
            run = second.run(f"s = nbddp.Session.attach({session_id!r})\n"
                             "s.run(lambda: kept + 1)", timeout=120).assert_ok()
            assert run.result() == "42"
            second.run("s.close()", timeout=120).assert_ok()
            assert ray_cluster.wait_empty() == {"actors": [], "placement_groups": []}
    finally:
        ray_cluster.remove_sessions()


def test_a_session_whose_grace_runs_out_leaves_nothing(ray_cluster, tmp_path):
    """No kernel comes back within the grace: the agents stop their ranks and remove the
    placement group themselves, and a new kernel finds no session to attach to."""
    with dying_kernel(ray_cluster, tmp_path / "first") as first:
        first.run(f"{START} --grace 20", timeout=180).assert_ok()
        cell(first, "kept = 1").assert_ok()
    (tmp_path / "second").mkdir()
    assert ray_cluster.state()["placement_groups"], "the grace keeps the session a while"
    assert ray_cluster.wait_empty(timeout=120) == {"actors": [], "placement_groups": []}
    with ray_kernel(ray_cluster, tmp_path / "second", start=None) as (second, _):
        run = second.run("%ddp_session attach", timeout=120)
        assert run.error() is not None and "no Ray session is running for this account" \
            in run.error_text(), run.describe()


USERS_OWN_RAY_INIT = "import ray\nray.init(address=os.environ['RAY_ADDRESS'])"
"""A notebook that connected to Ray itself first: its driver is in a namespace of its own
(anonymous), not nbddp's."""


@pytest.mark.parametrize("own_init", [False, True], ids=["nbddp-connects", "users-ray-init"])
def test_a_session_with_grace_is_attached_again_with_its_state(ray_cluster, tmp_path,
                                                               own_init):
    """Whether nbddp connected the kernel to Ray or the notebook did (each kernel in a
    namespace of its own), a new kernel finds the session and attaches to it."""
    with dying_kernel(ray_cluster, tmp_path / "first") as first:
        if own_init:
            first.run(USERS_OWN_RAY_INIT, timeout=60).assert_ok()
        first.run(f"{START} --grace 120", timeout=180).assert_ok()
        cell(first, "import torch.distributed as dist\nweights = [1, 2, 3]").assert_ok()
    (tmp_path / "second").mkdir()
    second = Kernel(tmp_path / "second")
    try:
        second.run(setup_cell(ray_cluster)).assert_ok()
        if own_init:
            second.run(USERS_OWN_RAY_INIT, timeout=60).assert_ok()
        attached = second.run("%ddp_session attach", timeout=120).assert_ok()
        assert "attached to Ray session" in attached.stream_text()
        assert cell(second, "sum(weights) * dist.get_world_size()").assert_ok().result() \
            == "12"
        second.run("%ddp_session stop").assert_ok()
        wait_until(lambda: ray_cluster.state() == {"actors": [], "placement_groups": []},
                   timeout=60, interval=0.5)
    finally:
        second.shutdown()
        ray_cluster.remove_sessions()  # (what a failure above left: not the next test's)


def test_agents_that_do_not_start_in_time_are_named_and_nothing_is_left(ray_cluster,
                                                                       tmp_path):
    """Ray does not start the agents' workers within the wait (a node with no core to
    spare): the session's start fails naming each node whose agent did not answer, and
    leaves no actor or placement group. (The kernel's wait is made shorter than any start
    could be.)"""
    with ray_kernel(ray_cluster, tmp_path, start=None) as (kernel, _):
        kernel.run("from nbddp._ray import placement\nplacement._START_WAIT = 0.001"
                   ).assert_ok()
        run = kernel.run(START, timeout=180)
        text = run.describe()
        assert run.error() is not None, text
        assert re.search(r"the nbddp agent on Ray node \S+, Ray node \S+ did not answer "
                         r"within 0.001 s", text), text
        assert ray_cluster.wait_empty() == {"actors": [], "placement_groups": []}
        kernel.run("placement._START_WAIT = 300").assert_ok()
        kernel.run(START, timeout=180).assert_ok()  # (the cluster is whole for the next)
        kernel.run("%ddp_session stop").assert_ok()


def test_a_placement_ray_cannot_make_says_so_and_ctrl_c_leaves_nothing(ray_cluster,
                                                                      tmp_path):
    """Three nodes asked of a two-node cluster: the session says what it waits for (an
    autoscaler could add the node), and Ctrl-C stops the wait, leaving nothing."""
    with ray_kernel(ray_cluster, tmp_path, start=None) as (kernel, _):
        run = kernel.submit("%ddp_session start --ray --nodes 3 --nprocs 1")
        run.wait_for_output("waiting for Ray to place 3 bundles", timeout=60)
        assert "2 nodes alive" in run.stream_text(), run.describe()
        kernel.km.interrupt_kernel()
        run.finish(timeout=120)
        assert run.error() is not None and run.error()["ename"] == "KeyboardInterrupt", \
            run.describe()
        assert ray_cluster.wait_empty() == {"actors": [], "placement_groups": []}
        kernel.run(START, timeout=180).assert_ok()  # (the cluster is whole for the next)
        kernel.run("%ddp_session stop").assert_ok()


def test_a_node_lost_mid_cell_ends_the_cell_naming_the_node(ray_cluster, tmp_path):
    """The second node's raylet dies while a cell runs, as a machine that is lost: the
    cell ends within seconds, the error says which node and that the state is gone, and
    nothing of the session is left on either node. (Last in the module: the cluster is
    one node short after it.)"""
    try:
        with ray_kernel(ray_cluster, tmp_path) as (kernel, _):
            cell(kernel, "kept = 1").assert_ok()
            run = kernel.submit("%%ddp\nimport time\nprint('working', flush=True)\n"
                                "time.sleep(120)")
            run.wait_for_output("working")
            ray_cluster.kill_node(1)
            began = time.monotonic()
            run.finish(timeout=120)
            took = time.monotonic() - began
            text = run.describe()
            assert run.error() is not None, text
            assert took < 30, f"the cell took {took:.0f} s to end:\n{text}"
            assert re.search(r"Ray node \S+ was lost \(its raylet is gone\)", text), text
            assert "variables defined in earlier cells are gone" in text, text
            kernel.run("%ddp_session stop", timeout=120).assert_ok()
            assert ray_cluster.wait_empty() == {"actors": [], "placement_groups": []}
    finally:
        ray_cluster.remove_sessions()
