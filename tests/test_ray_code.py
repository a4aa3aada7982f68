"""The notebook's own modules on a Ray node that cannot see the notebook's folder.

As on a rented cluster, where a pod has the image and not the notebook's files, the
second node of this two-node Ray cluster runs in a mount namespace of its own with an
empty tmpfs over the notebook's folder (``RayCluster.start(hidden=...)``). A kernel whose
working directory is that folder imports a module (``helpers``, which imports
``utils``) and a package with a data file (``mypkg``) from it: a session's cells and a
launch find them on both nodes, and an edit reaches both with autoreload on. The first
test checks that one node really cannot see the folder, so none can pass vacuously.
Last, a third node whose torch reports another version (a package's metadata put first
on its import path: the check is nbddp's own), and one that cannot import nbddp (its
source folder hidden), are named before any cell runs.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from .conftest import missing
from .kernel_driver import Kernel
from .ray_cluster import RayCluster, hiding_unavailable, unavailable

pytestmark = [pytest.mark.ray, pytest.mark.slow]

EVERY_RANK = ("import torch.distributed as dist\n"
              "_seen = [None] * dist.get_world_size()\n"
              "dist.all_gather_object(_seen, {value})\n"
              "_seen")


@pytest.fixture(scope="module")
def notebook_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("notebook")
    (folder / "utils.py").write_text("BASE = 41\n")
    (folder / "helpers.py").write_text("import utils\n\nVALUE = utils.BASE + 1\n")
    package = folder / "mypkg"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import model\n")
    (package / "model.py").write_text("class Net:\n    layers = 3\n")
    (package / "data" / "config.json").write_text(json.dumps({"width": 64}))
    return folder


@pytest.fixture(scope="module")
def ray_cluster(notebook_folder):
    reason = unavailable() or hiding_unavailable()
    if reason:
        missing("ray", reason)
    cluster = RayCluster()
    try:
        yield cluster.start(nodes=2, hidden=notebook_folder)
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def kernel(ray_cluster, notebook_folder):
    kernel = Kernel(notebook_folder)
    try:
        kernel.run(f"import os\nos.environ['RAY_ADDRESS'] = {ray_cluster.address!r}\n"
                   "import nbddp\n%load_ext nbddp").assert_ok()
        kernel.run("%ddp_session start --ray --nodes 2 --nprocs 1 --cpus-per-node 0.5",
                   timeout=180).assert_ok()
        yield kernel
        kernel.run("%ddp_session stop").assert_ok()
    finally:
        kernel.shutdown()
    assert ray_cluster.wait_empty() == {"actors": [], "placement_groups": []}


def every_rank(kernel: Kernel, value: str, before: str = "") -> list:
    """``value`` as each rank of the session sees it, in rank order."""
    run = kernel.run("%%ddp\n" + before + EVERY_RANK.format(value=value), timeout=120)
    run.assert_ok()
    return eval(run.result())  # noqa: S307 - a list of plain values the test made


def test_one_node_cannot_see_the_notebooks_folder(kernel, notebook_folder):
    seen = every_rank(kernel, f"os.path.exists({str(notebook_folder / 'helpers.py')!r})",
                      before="import os\n")
    assert sorted(seen) == [False, True], seen


def test_a_cell_imports_the_notebooks_module_and_package_on_both_nodes(kernel):
    assert kernel.run("import sys\n'helpers' in sys.modules").assert_ok().result() == "False"
    seen = every_rank(kernel, "(helpers.VALUE, Net.layers, json.loads("
                              "resources.files('mypkg').joinpath('data/config.json')"
                              ".read_text())['width'])",
                      before="import json\nfrom importlib import resources\n"
                             "import helpers\nfrom mypkg.model import Net\n")
    assert seen == [(42, 3, 64), (42, 3, 64)]


def test_an_edit_reaches_both_nodes_with_autoreload(kernel, notebook_folder):
    kernel.run("%ddp_session autoreload on").assert_ok()
    try:
        assert every_rank(kernel, "helpers.VALUE") == [42, 42]
        (notebook_folder / "helpers.py").write_text(textwrap.dedent("""\
            import utils

            VALUE = utils.BASE + 2

            def twice():
                return 2 * VALUE
            """))
        seen = every_rank(kernel, "(helpers.VALUE, helpers.twice())")
        assert seen == [(43, 86), (43, 86)]
        (notebook_folder / "utils.py").write_text("BASE = 99\n")
        assert every_rank(kernel, "utils.BASE", before="import utils\n") == [99, 99]
    finally:
        kernel.run("%ddp_session autoreload off").assert_ok()


def test_a_launch_calls_the_notebooks_module_on_both_nodes(kernel):
    run = kernel.run(textwrap.dedent("""\
        import helpers
        from mypkg.model import Net

        def uses_them():
            import torch.distributed as dist
            return dist.get_rank(), helpers.VALUE, Net.layers

        nbddp.launch(uses_them, nprocs=1, cluster=nbddp.Ray(nodes=2, cpus_per_node=0.5),
                     all_ranks=True)
        """), timeout=240)
    run.assert_ok()
    assert eval(run.result()) == [(0, 101, 3), (1, 101, 3)]  # noqa: S307


def test_after_cd_a_node_that_cannot_follow_stays_and_cells_still_run(kernel, notebook_folder):
    experiments = notebook_folder / "experiments"
    experiments.mkdir()
    kernel.run(f"%cd {experiments}").assert_ok()
    try:
        seen = every_rank(kernel, "(os.getcwd(), helpers.VALUE)", before="import os\n")
    finally:
        kernel.run(f"%cd {notebook_folder}").assert_ok()
    assert sorted(where == str(experiments) for where, _ in seen) == [False, True], seen
    assert [value for _, value in seen] == [43, 43]

def test_files_and_variables_go_rays_way_with_runtime_env(kernel, notebook_folder):
    """``working_dir`` and ``py_modules`` from the notebook's folder reach the node that
    cannot see it because Ray uploads them; ``env_vars`` reach the ranks."""
    run_files = notebook_folder / "run-files"
    (run_files / "shards").mkdir(parents=True)
    (run_files / "shards" / "labels.txt").write_text("cat dog\n")
    extras = notebook_folder / "extras" / "tokenizer"
    extras.mkdir(parents=True)
    (extras / "__init__.py").write_text("def split(text):\n    return text.split()\n")
    run = kernel.run(textwrap.dedent(f"""\
        def reads_them():
            import os, tokenizer
            import torch.distributed as dist
            with open("shards/labels.txt") as f:
                words = tokenizer.split(f.read())
            return dist.get_rank(), words, os.environ["LABEL_SET"]

        ray_env = {{"working_dir": {str(run_files)!r}, "py_modules": [{str(extras)!r}],
                    "env_vars": {{"LABEL_SET": "pets"}}}}
        with nbddp.Session(nprocs=1, cluster=nbddp.Ray(nodes=2, cpus_per_node=0.5,
                                                   runtime_env=ray_env)) as with_files:
            every = with_files.run_all(reads_them)
        every
        """), timeout=300)
    run.assert_ok()
    assert eval(run.result()) == [(0, ["cat", "dog"], "pets"),  # noqa: S307
                                  (1, ["cat", "dog"], "pets")]

def with_a_third_node(ray_cluster: RayCluster, kernel: Kernel, node: dict,
                      then: str = "") -> str:
    """What the kernel printed trying a session on three nodes (the third made with
    ``node``'s arguments, and gone after), then running ``then``."""
    ray_cluster.add_node(**node)
    try:
        run = kernel.run("three = nbddp.Ray(nodes=3, cpus_per_node=0.5)\n"
                         "try:\n    nbddp.Session(nprocs=1, cluster=three)\n"
                         "except nbddp.NbddpError as exc:\n    print('refused:', exc)\n"
                         + textwrap.dedent(then), timeout=300)
    finally:
        ray_cluster.stop_node(len(ray_cluster.nodes) - 1)
    return run.assert_ok().stream_text()


def test_a_node_with_another_torch_is_named_before_any_cell_runs(
        ray_cluster, kernel, tmp_path_factory):
    fake = tmp_path_factory.mktemp("other-torch")
    (fake / "torch-1.0.0.dist-info").mkdir()
    (fake / "torch-1.0.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 1.0.0\n")
    said = with_a_third_node(ray_cluster, kernel, {"env": {"PYTHONPATH": str(fake)}}, """\
        try:
            nbddp.launch(print, nprocs=1, cluster=three)
        except nbddp.WorkerError as exc:
            print("launch refused:", exc)
        """)
    assert "refused: the session's ranks cannot run here: node " in said, said
    assert "runs torch 1.0.0 (the notebook's kernel has 2." in said, said
    assert "one image" in said
    assert "launch refused: rank " in said and "VersionMismatch: node " in said, said
    assert kernel.run("%%ddp\n'cells still run'").assert_ok().result() == "'cells still run'"


def test_a_node_without_nbddp_is_named_before_any_cell_runs(ray_cluster, kernel):
    import nbddp

    said = with_a_third_node(ray_cluster, kernel, {"hidden": Path(nbddp.__file__).parent})
    assert "refused: the session's ranks cannot run here: nbddp cannot be imported on " \
           "Ray node " in said, said
    assert "No module named 'nbddp'" in said and "one image" in said


def test_a_node_that_vanishes_mid_cell_is_named_as_lost(ray_cluster, kernel):
    """Every process of the node that cannot see the notebook's folder is killed at
    once while a cell runs there (last in the module: the cluster is a node short)."""
    run = kernel.submit("%%ddp\nimport time\nprint('working', flush=True)\ntime.sleep(120)")
    run.wait_for_output("working")
    ray_cluster.kill_everything_of_node(1)
    run.finish(timeout=120)
    text = run.describe()
    assert run.error() is not None, text
    assert re.search(r"Ray node \S+ was lost \(its raylet is gone\)", text), text
    assert "variables defined in earlier cells are gone" in text, text
