"""Which launches standby ranks can take, and what they change at hand-over (pure rules)."""

from __future__ import annotations

import dataclasses

import pytest

from nbddp._run.groups.shape import GroupShape, Handover, read_at_start

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast

BASE = GroupShape(python="/usr/bin/python3", nprocs=2, cuda_visible_devices=None, gpus=0,
                  backend=None, init=True, env={"HOME": "/root", "OMP_NUM_THREADS": "1"},
                  cwd="/work")


def shape(**changes) -> GroupShape:
    return dataclasses.replace(BASE, **changes)


@pytest.mark.parametrize("name", ["CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "OMP_NUM_THREADS",
                                  "PYTHONPATH", "LD_LIBRARY_PATH", "TORCH_DISTRIBUTED_DEBUG",
                                  "PYTORCH_CUDA_ALLOC_CONF", "GLOO_SOCKET_IFNAME",
                                  "MKL_NUM_THREADS", "MASTER_PORT", "TMPDIR", "LANG"])
def test_variables_read_when_a_rank_starts(name):
    assert read_at_start(name)


@pytest.mark.parametrize("name", ["WANDB_PROJECT", "HF_HOME", "MY_SETTING", "PATH",
                                  "NBDDP_METRICS_DIR", "DATA_DIR"])
def test_variables_a_waiting_rank_can_take_up(name):
    assert not read_at_start(name)


def test_the_same_shape_needs_no_change():
    assert BASE.handover(shape()) == Handover()


@pytest.mark.parametrize("change", [dict(nprocs=3), dict(python="/opt/py/bin/python"),
                                    dict(backend="gloo"), dict(init=False), dict(gpus=1),
                                    dict(cuda_visible_devices="1")])
def test_another_launch_shape_means_a_cold_start(change):
    assert BASE.handover(shape(**change)) is None


def test_environment_changes_are_taken_up_unless_read_at_start():
    wanted = shape(env={"HOME": "/home/me", "WANDB_PROJECT": "x"})  # OMP_NUM_THREADS unset
    assert BASE.handover(wanted) is None
    wanted = shape(env={"HOME": "/home/me", "OMP_NUM_THREADS": "1", "WANDB_PROJECT": "x"})
    assert BASE.handover(wanted) == Handover(env={"HOME": "/home/me", "WANDB_PROJECT": "x"})
    assert BASE.handover(shape(env={"OMP_NUM_THREADS": "1"})) == Handover(env={"HOME": None})
    assert BASE.handover(shape(env={**BASE.env, "NCCL_DEBUG": "INFO"})) is None


def test_a_new_working_directory_is_taken_up():
    assert BASE.handover(shape(cwd="/data")) == Handover(cwd="/data")


@pytest.mark.parametrize("change, prepared", [
    (dict(), "gloo"),  # CPU ranks with the default backend use gloo: set it up ahead
    (dict(backend="gloo", gpus=2), "gloo"),
    (dict(gpus=2), None),  # NCCL: nothing touches a GPU before Start
    (dict(backend="nccl", gpus=2), None),
    (dict(init=False), None),  # the user's code sets up its own group
])
def test_what_ranks_set_up_before_their_start(change, prepared):
    assert shape(**change).prepare == prepared
