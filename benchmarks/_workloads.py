"""The code the benchmarks run on the ranks, defined once.

``bench_launch.py`` passes ``allreduce_once`` and ``train_mlp`` to ``nbddp.launch``;
``_plain.py`` imports and calls them under plain ``torchrun``. ``bench_metrics.py``
uses ``train_mlp`` (with ``log_every_step``), ``log_call_cost`` and
``print_timestamps``, under ``nbddp.launch`` only. All expect the default process group
to be initialised (gloo) by whoever calls them. ``nbddp`` is imported only inside the
functions that need it, so a plain-torchrun rank never imports it.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

IN_FEATURES, HIDDEN, CLASSES, BATCH, BATCHES = 128, 256, 10, 64, 16


def noop() -> None:
    """Nothing: a call's own cost, with its code already on the ranks (by reference)."""


def allreduce_once() -> float:
    """All-reduce one tensor over the default process group; return the sum (world size)."""
    value = torch.ones(1)
    dist.all_reduce(value)
    return float(value.item())


def _mlp_step(rank: int) -> Callable[[int], torch.Tensor]:
    """A seeded 2-layer MLP in DDP with SGD; the returned function runs one training step
    on synthetic batch ``i`` and returns its loss."""
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1234 + rank)
    xs = torch.randn(BATCHES, BATCH, IN_FEATURES, generator=gen)
    ys = torch.randint(0, CLASSES, (BATCHES, BATCH), generator=gen)

    def step(i: int) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(xs[i % BATCHES]), ys[i % BATCHES])
        loss.backward()
        optimizer.step()
        return loss

    return step


def train_mlp(steps: int, warmup: int, log_every_step: int = 0) -> dict[str, float]:
    """Train a 2-layer MLP with DDP and SGD on seeded synthetic data; return timed steps/s.

    With ``log_every_step`` (an int, so ``_plain.py`` can pass it), every step also calls
    ``nbddp.log(step=n, loss=loss.detach())`` (n counts every step, warmup included).
    """
    rank = dist.get_rank()
    step = _mlp_step(rank)
    log: Callable[..., None] | None = None
    if log_every_step:
        import nbddp

        log = nbddp.log

    for i in range(warmup):
        loss = step(i)
        if log is not None:
            log(step=i, loss=loss.detach())
    dist.barrier()
    start = time.perf_counter()
    if log is None:
        for i in range(steps):
            step(i)
    else:
        for i in range(steps):
            loss = step(i)
            log(step=warmup + i, loss=loss.detach())
    elapsed = time.perf_counter() - start
    return {"steps_per_s": steps / elapsed, "threads": float(torch.get_num_threads())}


def train_mlp_paired(blocks: int, block_steps: int, warmup: int) -> dict[str, list[float]]:
    """In one run, alternate blocks of steps with ``nbddp.log`` every step and without
    (ABBA order), timing each block between barriers: steps/s per kind of block.

    Pairing inside one run removes what varies from launch to launch (placement, other
    load), which on a small shared machine is larger than the cost being measured.
    """
    import nbddp

    step = _mlp_step(dist.get_rank())
    for i in range(warmup):
        step(i)
    rates: dict[str, list[float]] = {"with_log": [], "without_log": []}
    n = warmup
    for block in range(blocks):
        logging = block % 4 in (0, 3)  # ABBA: with, without, without, with, ...
        dist.barrier()
        start = time.perf_counter()
        for _ in range(block_steps):
            loss = step(n)
            if logging:
                nbddp.log(step=n, loss=loss.detach())
            n += 1
        dist.barrier()
        rates["with_log" if logging else "without_log"].append(
            block_steps / (time.perf_counter() - start))
    return rates


def train_mlp_clock_paired(blocks: int, block_steps: int) -> dict[str, list[float]]:
    """In one run, alternate blocks of steps (ABBA) iterated through ``nbddp.progress``
    and through a plain ``range``, timing each block between barriers: steps/s per kind.

    ``nbddp.progress`` times each step on each rank (the step clock): it looks for DDP
    models during its loop's first steps and has their timers sample every tenth
    iteration, read between steps. Each block trains a fresh model (built before its
    timer starts), so each ``progress`` block pays for finding it, and each plain block
    has DDP's own sampling rate.
    """
    import nbddp

    rates: dict[str, list[float]] = {"with_clock": [], "plain": []}
    for block in range(blocks):
        clocked = block % 4 in (0, 3)  # ABBA
        step = _mlp_step(dist.get_rank())
        dist.barrier()
        start = time.perf_counter()
        steps = nbddp.progress(range(block_steps)) if clocked else range(block_steps)
        for i in steps:
            step(i)
        dist.barrier()
        rates["with_clock" if clocked else "plain"].append(
            block_steps / (time.perf_counter() - start))
    rates["loop_us"] = [_loop_us(nbddp.progress), _loop_us(lambda steps: steps)]
    return rates


def _loop_us(wrap: Callable[[range], Any], steps: int = 200_000) -> float:
    """Microseconds per iteration of an empty loop over ``wrap(range(steps))``."""
    start = time.perf_counter()
    for _ in wrap(range(steps)):
        pass
    return (time.perf_counter() - start) / steps * 1e6


def _no_op(step: int | None = None, **metrics: Any) -> None:
    """What a call of ``nbddp.log`` costs at the least: a Python call with keywords."""


def log_call_cost(calls: int) -> dict[str, float]:
    """Microseconds per ``nbddp.log(step=i, loss=x, acc=y)`` call in a tight loop of
    ``calls`` calls: with Python floats, with 0-d tensors, and (for scale) an empty
    function called the same way; wall time (``*_us``) and the rank process's CPU time
    (``*_cpu_us``). Every rank runs the loops; the reporter is live."""
    import nbddp
    from nbddp._rank import metrics as _metrics

    if _metrics._reporter is None:
        raise RuntimeError("nbddp's reporter is not active: not a launched run?")
    loss_t, acc_t = torch.tensor(0.25), torch.tensor(0.75)  # like loss.detach()
    cases: list[tuple[str, Callable[..., None], Any, Any]] = [
        ("no_op_us", _no_op, 0.25, 0.75),
        ("float_us", nbddp.log, 0.25, 0.75),
        ("tensor_us", nbddp.log, loss_t, acc_t),
    ]
    out: dict[str, float] = {}
    first = 0
    for name, fn, x, y in cases:
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        for i in range(first, first + calls):
            fn(step=i, loss=x, acc=y)
        out[name] = (time.perf_counter() - start) / calls * 1e6
        # CPU time of the whole rank process (the reporter thread included): what the
        # calls cost whatever else the machine is doing
        out[name.replace("_us", "_cpu_us")] = (time.process_time() - cpu) / calls * 1e6
        first += calls  # each case logs steps of its own
        time.sleep(0.3)  # the reporter sends this case's records before the next starts
    return out


MARK = "nbddp-bench-ts"


def print_timestamps(count: int, interval_ms: int) -> dict[str, int]:
    """Rank 0 prints ``count`` lines ``MARK idle SEQ TIME`` while the ranks otherwise idle,
    then ``count`` lines ``MARK busy SEQ TIME`` while both ranks train the MLP with
    ``nbddp.log`` every step. TIME is ``time.time()`` just before the print; every print
    is flushed. The gaps between prints are drawn uniformly from 0.5 to 1.5 times
    ``interval_ms`` (seeded), so that they do not keep step with the kernel's polling."""
    import nbddp

    rank, interval = dist.get_rank(), interval_ms / 1000
    gaps = random.Random(0)
    dist.barrier()
    if rank == 0:
        for seq in range(count):
            print(f"{MARK} idle {seq} {time.time():.6f}", flush=True)
            time.sleep(interval * gaps.uniform(0.5, 1.5))
    dist.barrier()
    step, printed, i = _mlp_step(rank), 0, 0
    due = time.monotonic()
    done = torch.zeros(1)
    while True:
        loss = step(i)
        nbddp.log(step=i, loss=loss.detach())
        if rank == 0 and printed < count and time.monotonic() >= due:
            print(f"{MARK} busy {printed} {time.time():.6f}", flush=True)
            due, printed = time.monotonic() + interval * gaps.uniform(0.5, 1.5), printed + 1
        i += 1
        if i % 10 == 0:  # rank 0 says when to stop, so both ranks run the same steps
            done.fill_(float(printed >= count))
            dist.broadcast(done, src=0)
            if done.item():
                break
    return {"busy_steps": i}


def allreduce_once_cuda() -> float:
    """``allreduce_once`` on the rank's GPU (NCCL)."""
    value = torch.ones(1, device="cuda")
    dist.all_reduce(value)
    return float(value.item())


def train_conv(steps: int, warmup: int) -> dict[str, float]:
    """Train a small convolutional net with DDP on the rank's GPU, on seeded synthetic
    32x32 images; return timed steps/s (the GPU synchronised before each clock read), and
    the threads the rank runs beside it."""
    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    net = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(256, CLASSES)).to(device)
    model = DistributedDataParallel(net, device_ids=[device.index])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())
    xs = torch.randn(BATCHES, 128, 3, 32, 32, generator=gen, device=device)
    ys = torch.randint(0, CLASSES, (BATCHES, 128), generator=gen, device=device)

    def step(i: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(xs[i % BATCHES]), ys[i % BATCHES]).backward()
        optimizer.step()

    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    torch.cuda.synchronize()
    return {"steps_per_s": steps / (time.perf_counter() - start),
            "threads": sorted(t.name for t in threading.enumerate())}
