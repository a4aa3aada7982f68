"""What a Ray run or session is asked, checked before anything starts: ``nbddp.Ray``,
the ranks per node, and the magics' ``--ray`` flags. Pure logic: no cluster, no ray
import (``import nbddp`` never imports ray); where nbddp must connect, in a process of
its own, with no cluster to be found."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys

import pytest
from IPython.core.error import UsageError

import nbddp
from nbddp._backends import session_backend
from nbddp._cluster_flags import cluster_from_flags
from nbddp._magic import _check_combination
from nbddp._ray.options import ray_run
from nbddp._run.config import RunOptions

from .conftest import missing

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("bad", [{"nodes": 0}, {"nodes": True}, {"gpus_per_node": -1},
                                 {"cpus_per_node": 0}, {"grace": -1}, {"grace": "10"},
                                 {"runtime_env": ["working_dir"]},
                                 {"runtime_env": {"env_vars": {"X": object()}}}])
def test_bad_ray_options_are_refused_by_name(bad):
    name = next(iter(bad))
    with pytest.raises((ValueError, TypeError), match=f"Ray\\({name}="):
        nbddp.Ray(**bad)


def test_a_runtime_env_is_kept_as_given_and_says_whether_ranks_run_in_it():
    ray = nbddp.Ray(runtime_env={"working_dir": "data", "pip": ["einops"]})
    assert ray.runtime_env == {"working_dir": "data", "pip": ["einops"]}
    assert ray.working_dir and not nbddp.Ray(runtime_env={"env_vars": {"A": "1"}}).working_dir


def test_a_ray_client_address_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="Ray Client address: nbddp needs the kernel inside"):
        nbddp.Ray(address="ray://head:10001")


def test_nprocs_and_gpus_count_ranks_per_node():
    config, ray, per_node = ray_run(RunOptions(nprocs=3), nbddp.Ray(nodes=2))
    assert (config.nprocs, per_node, ray.gpus_per_node) == (6, 3, 0)
    config, ray, per_node = ray_run(RunOptions(gpus=2), True)
    assert (config.nprocs, per_node, ray.gpus_per_node, ray.bundle()) == \
        (4, 2, 2, {"CPU": 1, "GPU": 2})


@pytest.mark.parametrize("options, ray, message", [
    (RunOptions(nprocs=2, gpus=3), True, "nprocs=2 disagrees with gpus=3"),
    (RunOptions(gpus=2), nbddp.Ray(gpus_per_node=4), "gpus=2 disagrees with Ray"),
    (RunOptions(max_restarts=1), True, "takes no max_restarts"),
    (RunOptions(), "yes", "ray must be True or nbddp.Ray"),
])
def test_a_shape_that_cannot_be_is_refused(options, ray, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ray_run(options, ray)


def test_grace_is_given_once():
    with pytest.raises(ValueError, match="disagrees with Ray\\(grace=5\\)"):
        session_backend(RunOptions(), nbddp.Ray(grace=5), grace=10)


def _parsed(line: str):
    from IPython.core.magic_arguments import parse_argstring

    from nbddp._magic import DDPMagics

    return parse_argstring(DDPMagics.ddp, line)


def test_the_magic_flags_make_the_options():
    args = _parsed("--ray --nodes 3 --address 10.0.0.1:6379 --cpus-per-node 4")
    _check_combination(args)
    assert cluster_from_flags(args, gpus_per_node=1) == nbddp.Ray(
        nodes=3, gpus_per_node=1, cpus_per_node=4, address="10.0.0.1:6379")


@pytest.mark.parametrize("line, message", [
    ("--address 10.0.0.1:6379", "--address describes a Ray placement: add --ray"),
    ("--address 10.0.0.1:6379 --cpus-per-node 2", "describe a Ray placement: add --ray"),
    ("--ray --slurm", "one cluster: --slurm or --ray, not both"),
    ("--ray --export job.py", "--export writes the job's files and --ray runs the cell"),
    ("--ray --time 00:10:00", "--time describes a SLURM job"),
])
def test_flags_that_do_not_go_together_are_refused(line, message):
    with pytest.raises(UsageError, match=message):
        _check_combination(_parsed(line))


CONNECT = """
import nbddp
try:
    nbddp.launch(print, nprocs=1, cluster=nbddp.Ray(nodes=2, address=ADDRESS))
except nbddp.NbddpError as error:
    print(error)
"""


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # (closed again: nothing listens there)


NEEDS_RAY = pytest.mark.ray
"""(A test that runs ray's own code: skipped where ray is not installed, by the fixture
below, and failed instead where the run requires ray.)"""


@pytest.fixture(autouse=True)
def _ray_installed(request):
    if request.node.get_closest_marker("ray") and importlib.util.find_spec("ray") is None:
        missing("ray", "ray is not installed (pip install 'nbddp[ray]')")


def _launch_says(address: str | None, ray_address: str, first: str = "",
                 **env_too: str) -> str:
    """What a launch on Ray at ``address`` prints, in a process of its own (which runs
    ``first`` before it), with ``env_too`` in its environment."""
    env = {**os.environ, "RAY_ADDRESS": ray_address, **env_too}
    code = first + CONNECT.replace("ADDRESS", repr(address))
    return subprocess.run([sys.executable, "-c", code], env=env, timeout=60,
                          capture_output=True, text=True).stdout


@NEEDS_RAY
@pytest.mark.parametrize("where", ["address", "RAY_ADDRESS"])
def test_no_cluster_at_the_address_given_is_a_clear_error_at_once(where):
    """Given where nothing answers, the launch says so, and how to start a cluster, before
    anything starts (``ray.init`` would retry for minutes)."""
    address = f"127.0.0.1:{_closed_port()}"
    said = _launch_says(address, "") if where == "address" else _launch_says(None, address)
    assert f"no Ray cluster reachable at '{address}' (nothing answers there" in said, said
    assert "start one (`ray start --head` on this machine" in said, said


@NEEDS_RAY
def test_a_dead_cluster_s_address_left_by_ray_start_is_a_clear_error_at_once(tmp_path):
    """No address given: Ray would take the one the last ``ray start`` left in its temp
    folder, which stays after a cluster killed without ``ray stop``, and retry it for
    minutes. The launch says that nothing answers there, and where the address came
    from. (Ray's look for clusters running on this machine, which would take a test
    cluster running beside this test instead, finds none here.)"""
    port = _closed_port()
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}")
    said = _launch_says(None, "", first=NO_RAY_RUNNING, RAY_TMPDIR=str(tmp_path))
    assert re.search(rf"no Ray cluster reachable at '[0-9.]+:{port}' \(nothing answers "
                     r"there: .*the last `ray start`'s on this machine", said), said


NO_RAY_RUNNING = ("import functools, ray._private.services as services\n"
                  "services.find_gcs_addresses = functools.cache(lambda: [])\n")


@NEEDS_RAY
def test_a_ray_client_address_in_ray_address_is_refused_with_the_reason():
    said = _launch_says(None, "ray://head:10001")
    assert "RAY_ADDRESS=ray://head:10001 is a Ray Client address: nbddp needs the kernel " \
        "inside the cluster" in said, said


def test_without_ray_installed_a_ray_run_says_how_to_install_it():
    said = _launch_says(None, "", first="import sys; sys.modules['ray'] = None\n")
    assert "ray is not installed in this kernel's environment: pip install 'nbddp[ray]'" \
        in said, said
