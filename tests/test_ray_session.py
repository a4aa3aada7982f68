"""Sessions and launches on a real two-node Ray cluster, through a real kernel.

``%ddp_session start --ray --nodes 2`` asks Ray for one placement group (a bundle on
each node), starts an agent in each bundle, and each agent's torchrun; cells then run
on both nodes' ranks as in any session. The cluster's two nodes share this machine:
they are told apart by Ray's node id, which names each rank's node. Every test checks
what a user would: the cell's value or error, the ranks' state, and that nothing of the
session is left (no actor, placement group, process or file) once it is stopped.
"""

from __future__ import annotations

import pytest

from .conftest import missing
from .kernel_driver import Kernel
from .ray_cluster import RayCluster, unavailable
from .test_pdb import answer

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.waits]

START = "%ddp_session start --ray --nodes 2 --nprocs 1"


@pytest.fixture(scope="module")
def ray_cluster():
    reason = unavailable()
    if reason:
        missing("ray", reason)
    cluster = RayCluster()
    try:
        yield cluster.start(nodes=2)
    finally:
        cluster.stop()


def setup_cell(cluster: RayCluster) -> str:
    return (f"import os\nos.environ['RAY_ADDRESS'] = {cluster.address!r}\n"
            "import nbddp\n%load_ext nbddp")


@pytest.fixture(scope="module")
def ray_session(ray_cluster, tmp_path_factory):
    """One kernel with a two-node Ray session open, for the tests that keep it whole."""
    kernel = Kernel(tmp_path_factory.mktemp("ray-session"))
    try:
        kernel.run(setup_cell(ray_cluster)).assert_ok()
        kernel.run(START, timeout=180).assert_ok()
        yield kernel
        kernel.run("%ddp_session stop").assert_ok()
    finally:
        kernel.shutdown()
    assert ray_cluster.wait_empty() == {"actors": [], "placement_groups": []}


def cell(kernel: Kernel, body: str, options: str = "", timeout: float = 90):
    return kernel.run(f"%%ddp {options}\n{body}", timeout=timeout)


def node_of_rank(kernel: Kernel) -> dict[int, str]:
    run = kernel.run("_status = %ddp_session\n_status.hosts").assert_ok()
    return eval(run.result())  # noqa: S307 - our own repr


def test_cells_keep_state_on_both_nodes(ray_session):
    hosts = node_of_rank(ray_session)
    assert sorted(hosts) == [0, 1]
    assert hosts[0] != hosts[1], "each rank on a node of its own"
    cell(ray_session, "import torch, torch.distributed as dist\n"
                      "total = torch.ones(3) * (dist.get_rank() + 1)\n"
                      "dist.all_reduce(total)").assert_ok()
    run = cell(ray_session, "print('rank 0 says', total.tolist())\ntotal.sum().item()")
    run.assert_ok()
    assert "rank 0 says [3.0, 3.0, 3.0]" in run.stream_text()
    assert run.result() == "9.0"
    status = ray_session.run("%ddp_session").assert_ok()
    assert "Ray session ray-" in status.result()


def test_notebook_names_ship_by_value(ray_session):
    ray_session.run("scale = 7\ndef double(x):\n    return 2 * x").assert_ok()
    run = cell(ray_session, "double(scale) + dist.get_world_size()").assert_ok()
    assert run.result() == "16"


def test_a_failing_rank_on_the_second_node_keeps_the_state(ray_session):
    run = cell(ray_session, "kept = 41\n"
                            "dist.barrier()\n"  # (every rank has kept it before one fails)
                            "if dist.get_rank() == 1:\n    raise ValueError('bad batch')")
    error = run.error()
    assert error is not None and error["ename"] == "WorkerError", run.describe()
    assert "rank 1" in error["evalue"] and "bad batch" in run.describe()
    assert "back at rest, with their state" in run.describe()
    assert cell(ray_session, "kept + 1").assert_ok().result() == "42"


def test_an_interrupt_stops_the_cell_and_keeps_the_state(ray_session):
    cell(ray_session, "kept_too = 'still here'").assert_ok()
    run = ray_session.submit("%%ddp\nimport time\nprint('working', flush=True)\n"
                             "while True:\n    time.sleep(0.01)")
    run.wait_for_output("working")
    ray_session.km.interrupt_kernel()
    run.finish(timeout=60)
    assert run.error()["ename"] == "KeyboardInterrupt", run.describe()
    assert "back at rest, with their state" in run.error_text(), run.describe()
    assert cell(ray_session, "kept_too").assert_ok().result() == "'still here'"


def test_a_cell_timeout_says_where_each_rank_is_and_keeps_the_state(ray_session):
    run = cell(ray_session, "import time\n"
                            "def wait_here():\n    time.sleep(60)\n"
                            "wait_here()", options="--timeout 5", timeout=120)
    error = run.error()
    assert error is not None and error["ename"] == "TimeoutError", run.describe()
    text = run.error_text()
    assert "rank 1: in wait_here" in text, text
    assert "back at rest, with their state" in text, text


def test_pdb_on_the_second_nodes_rank_is_answered_in_the_notebook(ray_session):
    second = node_of_rank(ray_session)[1]
    run = ray_session.submit(f"""%%ddp
import os, torch.distributed as dist
x = 40 + dist.get_rank()
if os.environ["NBDDP_NODE_NAME"] == {second!r}:
    breakpoint()
dist.barrier()
x + 2
""")
    answer(run, "[rank 1] (Pdb) ", "p os.environ['NBDDP_NODE_NAME'], x")
    answer(run, "[rank 1] (Pdb) ", "c")
    run.finish(timeout=60).assert_ok()
    assert f"({second!r}, 41)" in run.stream_text(), run.describe()
    assert run.result() == "42"  # rank 0's value


def test_a_cells_options_work_as_in_a_local_session(ray_session):
    """``--ranks`` (the others keep their state), ``--all-ranks`` (every rank's output,
    labelled) and ``--out``, on a Ray session's ranks."""
    cell(ray_session, "import torch.distributed as dist\nmark = 'both'").assert_ok()
    cell(ray_session, "mark = 'second only'", options="--ranks 1").assert_ok()
    marks = cell(ray_session, "print('mark:', mark, flush=True)", options="--all-ranks")
    said = marks.assert_ok().stream_text()
    assert "[rank 0] mark: both" in said and "[rank 1] mark: second only" in said, said
    cell(ray_session, "brought = [dist.get_rank(), mark]", options="--out brought").assert_ok()
    assert ray_session.run("brought").assert_ok().result() == "[0, 'both']"


def test_post_mortem_on_the_second_nodes_rank_with_ddp_debug(ray_session):
    """A failed cell's rank keeps its failure; ``%ddp_debug`` opens pdb at its frame,
    answered in the notebook, and the session's state is kept."""
    cell(ray_session, "import torch.distributed as dist\nx = 40 + dist.get_rank()").assert_ok()
    failed = cell(ray_session, "if dist.get_rank() == 1:\n    y = x / 0")
    assert failed.error()["ename"] == "WorkerError", failed.describe()
    debugging = ray_session.submit("%ddp_debug")
    answer(debugging, "[rank 1] (Pdb) ", "p x")
    answer(debugging, "[rank 1] (Pdb) ", "q")
    debugging.finish(timeout=60).assert_ok()
    assert "\n41\n" in debugging.stream_text(), debugging.describe()
    assert cell(ray_session, "x").assert_ok().result() == "40"


MAPPED_FROM = """
def mapping_of(t):
    import os
    address = t.data_ptr()
    for line in open("/proc/self/maps"):
        parts = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start <= address < end:
            return parts[3], parts[4], parts[5].strip() if len(parts) > 5 else ""

def mapped_from(t):
    import os
    path = mapping_of(t)[2]
    return os.path.basename(os.path.dirname(path))[:11], os.path.basename(path)[:8]
"""
"""Cell code: the device, inode and path of the file a tensor's memory maps
(``mapping_of``), and its folder's and name's beginnings (``mapped_from``)."""


def test_a_gib_argument_and_result_cross_once_per_node(ray_session):
    """The argument goes through Ray's object store: each node's agent writes it into the
    node's shared memory, where the node's ranks map it."""
    ray_session.run("import torch\n"
                    "big = torch.arange(2**27, dtype=torch.float64)  # 1 GiB").assert_ok()
    ray_session.run(MAPPED_FROM).assert_ok()
    run = ray_session.run("def checked(t):\n"
                          "    import torch.distributed as dist\n"
                          "    return float(t[-1]) + dist.get_rank(), mapped_from(t)\n"
                          "_session = get_ipython().magics_manager.registry['DDPMagics']"
                          ".session\n"
                          "_session.run_all(checked, big)", timeout=300).assert_ok()
    mapped = ("nbddp-node-", "payload-")
    assert eval(run.result()) == [(2.0**27 - 1, mapped), (2.0**27, mapped)]  # noqa: S307
    back = ray_session.run("got = _session.run(lambda: torch.full((2**27,), 3.0,\n"
                           "                                      dtype=torch.float64))\n"
                           "(got.numel(), float(got.sum()))", timeout=300).assert_ok()
    assert back.result() == f"({2**27}, {3.0 * 2**27})"
    channel = ray_session.run("os.environ['NBDDP_SESSION_DATA'] = 'channel'\n"
                              "try:\n"
                              "    _on = _session.run_all(checked, big[:2**24])\n"
                              "finally:\n"
                              "    del os.environ['NBDDP_SESSION_DATA']\n"
                              "[where[1][1].startswith('payload-') for where in _on]",
                              timeout=300).assert_ok()
    assert channel.result() == "[False, False]"  # (over the channel: received files)
    ray_session.run("del big, got").assert_ok()


def test_the_per_rank_view_names_each_ranks_node(ray_session):
    """The panel's per-rank line: each rank on its own node, named as Ray's node id tells
    them apart (the test cluster's two nodes share one host name)."""
    hosts = node_of_rank(ray_session)
    run = ray_session.run("""
import time
_session = get_ipython().magics_manager.registry['DDPMagics'].session
_job = _session.submit(lambda: time.sleep(3), all_ranks=True, output="none")
_job.result()
{rank: info["host"] for rank, info in _job.ranks.items()}
""", timeout=120).assert_ok()
    assert eval(run.result()) == hosts  # noqa: S307 - our own repr
