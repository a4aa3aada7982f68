"""CUDA/NCCL paths. Skipped where no GPU is visible (CI has none)."""

from __future__ import annotations

import pytest

import nbddp
from nbddp._devices import visible_gpu_count

GPUS = visible_gpu_count()
pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU; none is visible")
needs_two = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")


def device_and_backend():
    import torch
    import torch.distributed as dist

    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    return torch.cuda.current_device(), dist.get_backend(), t


@needs_gpu
def test_default_is_one_nccl_rank_per_gpu_and_tensors_come_back_on_cpu():
    results = nbddp.launch(device_and_backend, all_ranks=True)
    assert [r[0] for r in results] == list(range(GPUS))
    assert {r[1] for r in results} == {"nccl"}
    assert all(r[2].device.type == "cpu" and r[2].item() == GPUS for r in results)


@needs_gpu
def test_a_kernel_that_initialised_cuda_can_still_launch():
    import torch

    torch.ones(1, device="cuda")  # CUDA is initialised in this (the kernel's) process
    assert torch.cuda.is_initialized()
    assert nbddp.launch(device_and_backend, gpus=1)[1] == "nccl"


@needs_two
def test_gpus_picks_devices():
    def visible():
        import os

        return os.environ["CUDA_VISIBLE_DEVICES"]

    assert nbddp.launch(visible, gpus=[1]) in ("1", visible_ids()[1])


def visible_ids():
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(GPUS)))).split(",")


@needs_gpu
def test_asking_for_more_gpus_than_visible_is_an_error():
    with pytest.raises(ValueError, match="GPU"):
        nbddp.launch(device_and_backend, gpus=GPUS + 1)
