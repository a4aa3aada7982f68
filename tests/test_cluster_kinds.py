"""A cluster kind is its package plus one registry line: the tests' own loopback kind
(``tests/loopback``) registers itself, and from then on ``launch(cluster=...)``,
``Session(cluster=...)`` and the magics' ``--loopback`` run through it, with nothing
else in nbddp told of it. The older ``slurm=`` / ``ray=`` spellings still choose their
kind, with a warning that names the new one."""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from pathlib import Path

import pytest

import nbddp
from nbddp._backends import KINDS, chosen_cluster, kind_of, register

from .kernel_driver import Kernel

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def loopback():
    """The loopback kind, registered in this process for the test (and taken out after)."""
    sys.modules.pop("tests.loopback", None)
    module = importlib.import_module("tests.loopback")
    try:
        yield module
    finally:
        KINDS.remove(module.LOOPBACK)


def _label() -> str:
    return os.environ.get("NBDDP_LOOPBACK", "not through the loopback kind")


@pytest.mark.fast
def test_a_registered_kind_runs_launch_and_a_session(loopback):
    assert kind_of(loopback.Loopback()) is loopback.LOOPBACK
    got = nbddp.launch(_label, nprocs=2, cluster=loopback.Loopback(label="L1"), all_ranks=True)
    assert got == ["L1", "L1"]
    with nbddp.Session(nprocs=2, cluster=loopback.Loopback(label="S1")) as session:
        assert session.run_all(_label) == ["S1", "S1"]


@pytest.mark.fast
def test_a_kind_is_registered_once_and_unknown_options_are_named(loopback):
    with pytest.raises(ValueError, match="registered already"):
        register(loopback.LoopbackKind())
    with pytest.raises(TypeError, match=r"cluster= takes one of nbddp.Slurm\(...\), "
                                        r"nbddp.Ray\(...\), nbddp.Loopback\(...\), got 'here'"):
        nbddp.launch(_label, nprocs=1, cluster="here")
    with pytest.raises(ValueError, match="no grace"):
        nbddp.Session(nprocs=1, cluster=loopback.Loopback(), grace=5)


@pytest.mark.fast
def test_the_older_spellings_choose_their_kind_and_say_the_new_one():
    with pytest.warns(DeprecationWarning, match=r"slurm= is now cluster=: write "
                                                r"cluster=nbddp.Slurm\(\)"):
        assert chosen_cluster(None, slurm=True) == nbddp.Slurm()
    with pytest.warns(DeprecationWarning, match=r"cluster=nbddp.Ray\(...\)"):
        assert chosen_cluster(None, ray=nbddp.Ray(nodes=3)) == nbddp.Ray(nodes=3)
    with pytest.raises(ValueError, match="one cluster: give cluster=, not slurm= as well"):
        chosen_cluster(nbddp.Ray(), slurm=True)
    with pytest.raises(ValueError, match="not slurm= and ray= both"):
        chosen_cluster(None, slurm=True, ray=True)
    with pytest.raises(TypeError, match=r"slurm must be True or nbddp.Slurm\(...\)"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        chosen_cluster(None, slurm="yes")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert chosen_cluster(nbddp.Ray()) == nbddp.Ray()  # (the new spelling: no warning)


@pytest.mark.slow
def test_the_magics_take_a_kind_registered_in_the_notebook(fresh_kernel: Kernel):
    """Registered in the notebook after ``%load_ext``: ``%%ddp -h`` lists its flags, a
    cell and a session run through it, and a flag of it without its word is refused."""
    kernel = fresh_kernel
    kernel.run("%load_ext nbddp").assert_ok()
    kernel.run(f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
               "import tests.loopback").assert_ok()
    helped = kernel.run("%ddp -h").assert_ok().stream_text()
    assert "--loopback" in helped and "--label TEXT" in helped, helped
    run = kernel.run("%%ddp --loopback --label cell --nprocs 2\n"
                     "import os\nos.environ['NBDDP_LOOPBACK']").assert_ok()
    assert run.result() == "'cell'", run.describe()
    refused = kernel.run("%%ddp --label cell\nx = 1").assert_ok()
    assert "--label describes a Loopback run: add --loopback" in refused.stream_text("stderr")
    kernel.run("%ddp_session start --loopback --label kept --nprocs 2").assert_ok()
    try:
        run = kernel.run("%%ddp\nimport os\nos.environ['NBDDP_LOOPBACK']").assert_ok()
        assert run.result() == "'kept'", run.describe()
    finally:
        kernel.run("%ddp_session stop").assert_ok()
