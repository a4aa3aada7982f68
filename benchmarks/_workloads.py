"""The code both launchers run, defined once: one all-reduce, and a small DDP training loop.

``bench_launch.py`` passes these functions to ``nbddp.launch``; ``_plain.py`` imports
and calls them under plain ``torchrun``. Both expect the default process group to be
initialised (gloo) by whoever calls them.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

IN_FEATURES, HIDDEN, CLASSES, BATCH, BATCHES = 128, 256, 10, 64, 16


def allreduce_once() -> float:
    """All-reduce one tensor over the default process group; return the sum (world size)."""
    value = torch.ones(1)
    dist.all_reduce(value)
    return float(value.item())


def train_mlp(steps: int, warmup: int) -> dict[str, float]:
    """Train a 2-layer MLP with DDP and SGD on seeded synthetic data; return timed steps/s."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1234 + rank)
    xs = torch.randn(BATCHES, BATCH, IN_FEATURES, generator=gen)
    ys = torch.randint(0, CLASSES, (BATCHES, BATCH), generator=gen)

    def step(i: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(xs[i % BATCHES]), ys[i % BATCHES]).backward()
        optimizer.step()

    for i in range(warmup):
        step(i)
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    elapsed = time.perf_counter() - start
    return {"steps_per_s": steps / elapsed, "threads": float(torch.get_num_threads())}
