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


@pytest.fixture(scope="module")
def cuda_here():
    """CUDA initialised in this (the kernel's) process, before the leftover check looks:
    the CUDA driver keeps a socket of its own open from then on."""
    import torch

    torch.ones(1, device="cuda")


@needs_gpu
def test_a_kernel_that_initialised_cuda_can_still_launch(cuda_here):
    import torch

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
        torchrun, rank = state.pids
        # (torchrun itself asks CUDA whether there are GPUs, as plain torchrun does: its
        # launch config's NUMA default. That opens the device, with no context or memory.)
        assert not cuda_device_holders([rank]), "an idle standby rank opened a GPU"
        assert not gpu_processes() & set(state.pids), "an idle standby group holds GPU memory"
        job = nbddp.launch(device_and_backend, gpus=1, wait=False)
        device, backend, tensor = job.result()
        assert job.warm and (device, backend, tensor.item()) == (0, "nccl", 1.0)
    finally:
        nbddp.standby(False)


def gpu_processes() -> set[int]:
    """The processes holding GPU memory (``nvidia-smi``'s compute processes)."""
    import subprocess

    listed = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                            capture_output=True, text=True, check=True).stdout
    return {int(pid) for pid in listed.split()}


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


@needs_gpu
def test_a_cuda_tensor_from_the_notebook_arrives_on_the_ranks_gpu_and_comes_back_on_the_cpu(
        cuda_here):
    """What a cell captures on the kernel's GPU lands on each rank's own device (views of
    one storage still share it there); what comes back is on the CPU, as every result."""
    import torch

    x = torch.arange(6.0, device="cuda").reshape(2, 3)
    model = torch.nn.Linear(3, 2).cuda()

    def on_rank(x, row, model):
        param = next(model.parameters())
        return (str(x.device), x.untyped_storage().data_ptr() == row.untyped_storage().data_ptr(),
                type(param).__name__, str(param.device), model(x).shape, x * 2)

    device, shared, kind, param_device, shape, doubled = nbddp.launch(
        on_rank, gpus=1, args=(x, x[1], model))
    assert (device, shared, kind, param_device) == ("cuda:0", True, "Parameter", "cuda:0")
    assert tuple(shape) == (2, 2)
    assert doubled.device.type == "cpu" and torch.equal(doubled, x.cpu() * 2)


@needs_gpu
def test_an_fsdp2_model_on_nccl_comes_back_whole():
    def train():
        import torch
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4)).cuda()
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(8, 16, device="cuda")).sum().backward()
        opt.step()
        return model, type(model[0].weight).__name__

    model, on_rank = nbddp.launch(train, gpus=1)
    import torch

    assert on_rank == "DTensor"  # sharded on the rank
    weights = [p for p in model.parameters()]
    assert [tuple(p.shape) for p in weights] == [(32, 16), (32,), (4, 32), (4,)]
    assert all(type(p.data) is torch.Tensor and p.device.type == "cpu" for p in weights)
    assert model(torch.randn(2, 16)).shape == (2, 4)


@needs_two
def test_a_rank_failing_in_a_nccl_collective_frees_its_peer_quickly():
    def fails():
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 gives up")
        t = torch.ones(1, device="cuda")
        dist.all_reduce(t)  # waits for rank 1, which never comes
        return t

    import time

    start = time.monotonic()
    with pytest.raises(nbddp.WorkerError, match="rank 1 gives up"):
        nbddp.launch(fails, gpus=2)
    assert time.monotonic() - start < 60


RAY_GPUS = """
def seen():
    import os
    import torch
    on = torch.ones(1, device="cuda")
    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count(), on.device.type
nbddp.launch(seen, nprocs=1, backend="gloo", all_ranks=True,
             cluster=nbddp.Ray(nodes=2, gpus_per_node=1))
"""


@needs_gpu
@pytest.mark.ray
def test_ray_ranks_use_the_gpu_ray_assigned_to_their_bundle(tmp_path):
    """Each node's ranks see the GPUs Ray gave the node's bundle, and only those. (Both
    test nodes detect this machine's GPUs, so each bundle gets one: gloo, as NCCL would
    refuse two ranks on one device.)"""
    from .kernel_driver import Kernel
    from .ray_cluster import RayCluster, unavailable
    from .test_ray_session import setup_cell

    if unavailable():
        pytest.skip(unavailable())
    cluster = RayCluster().start(nodes=2)
    kernel = Kernel(tmp_path)
    try:
        kernel.run(setup_cell(cluster)).assert_ok()
        run = kernel.run(RAY_GPUS, timeout=300).assert_ok()
        seen = eval(run.result())  # noqa: S307 - our own repr
        assert len(seen) == 2, seen
        for visible, count, device in seen:
            assert visible is not None and len(visible.split(",")) == 1, seen
            assert (count, device) == (1, "cuda"), seen
        assert cluster.wait_empty() == {"actors": [], "placement_groups": []}
    finally:
        kernel.shutdown()
        cluster.stop()
