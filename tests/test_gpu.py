"""CUDA/NCCL paths. Skipped where no GPU is visible (CI has none)."""

from __future__ import annotations

import pytest

import nbddp
from nbddp._run.devices import visible_gpu_count

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


def cuda_device_holders(pids) -> set[int]:
    """Those of ``pids`` that have a GPU open (``/dev/nvidiaN``): what a CUDA context needs."""
    import glob
    import os
    import re

    holders = set()
    for pid in pids:
        for fd in glob.glob(f"/proc/{pid}/fd/*"):
            try:
                if re.fullmatch(r"/dev/nvidia\d+", os.readlink(fd)):
                    holders.add(pid)
            except OSError:
                continue
    return holders


@needs_gpu
def test_standby_ranks_hold_no_gpu_and_a_warm_nccl_launch_works():
    from .conftest import wait_until

    nbddp.standby(True)
    try:
        nbddp.launch(device_and_backend, gpus=1)
        state = wait_until(lambda: (s if (s := nbddp.standby()).status == "ready" else None),
                           timeout=120)
        assert len(state.pids) == 2  # torchrun and the rank
        assert not cuda_device_holders(state.pids), "an idle standby rank opened a GPU"
        job = nbddp.launch(device_and_backend, gpus=1, wait=False)
        device, backend, tensor = job.result()
        assert job.warm and (device, backend, tensor.item()) == (0, "nccl", 1.0)
    finally:
        nbddp.standby(False)


def holds_gpu_memory(flag: str, mb: int):
    """Hold ``mb`` MiB (times rank + 1) on this rank's GPU until ``flag`` exists."""
    import pathlib
    import time

    import torch
    import torch.distributed as dist

    block = torch.empty((dist.get_rank() + 1) * mb * 2**20, dtype=torch.uint8, device="cuda")
    while not pathlib.Path(flag).exists():
        time.sleep(0.1)
    return block.numel()


def gpu_memory_seen(job, ranks: int, mb: int) -> dict[int, float]:
    """Each rank's reported GPU memory, once every rank reports what it holds."""
    from .conftest import wait_until

    def held():
        view = job.ranks
        mine = {rank: info["gpu_mem_mb"] or 0.0 for rank, info in view.items()}
        return mine if len(mine) == ranks and all(
            mine[rank] >= (rank + 1) * mb for rank in mine) else None

    return wait_until(held, timeout=120, interval=0.2)


@needs_gpu
def test_a_rank_reports_the_memory_it_holds_on_its_gpu(tmp_path):
    flag = tmp_path / "stop"
    job = nbddp.launch(holds_gpu_memory, gpus=1, args=(str(flag), 256), wait=False,
                       output="none")
    try:
        assert gpu_memory_seen(job, 1, 256)[0] < 256 + 64
    finally:
        flag.touch()
    job.result(timeout=60)


@needs_two
def test_each_rank_reports_its_own_gpus_memory_not_the_first_gpus(tmp_path):
    """The stats are read on a thread of the rank's own, whose current GPU is the first:
    rank 1 (512 MiB on GPU 1) would report GPU 0's, where it holds nothing."""
    flag = tmp_path / "stop"
    job = nbddp.launch(holds_gpu_memory, gpus=2, args=(str(flag), 256), wait=False,
                       output="none")
    try:
        seen = gpu_memory_seen(job, 2, 256)
        assert seen[0] < 256 + 64 and 512 <= seen[1] < 512 + 64
    finally:
        flag.touch()
    job.result(timeout=60)
