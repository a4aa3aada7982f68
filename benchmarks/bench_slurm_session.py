"""Benchmark a session on a SLURM cluster: its start, a cell's round trip, a large argument.

On ``--nodes`` nodes with 2 CPU ranks each (gloo), through a real Jupyter kernel as a
person meets it:

1. **Start**: ``Session(nprocs=2, cluster=Slurm(nodes=N))`` from the call until every
   rank is ready, against a bare ``sbatch`` of ``srun torchrun`` that runs one
   all-reduce and is timed until it has left the queue (``bench_slurm``'s plain job),
   alternated. Target: at most ``START_TARGET`` times the plain job.
2. **Round trip**: a trivial ``%%ddp`` cell on an open two-node session, timed by the
   Jupyter client from the execute request to the kernel going idle, with a plain cell
   for reference. Target: median at most ``ROUND_TRIP_TARGET`` s.
3. **A large argument**: a ``%%ddp`` cell that reads a notebook tensor of ``--gib`` GiB
   (sent with the cell), less the trivial cell's time: the rate from the kernel to the
   ranks of every node (one copy per node, into its shared memory; the route is the
   session's, ``NBDDP_SESSION_DATA``). Target: at least ``ARGUMENT_TARGET`` bytes/s.
4. **A large result**: the same cell, which also sends the tensor back (``--out``),
   less the large argument's time: the rate from rank 0 back to the kernel.

Needs a SLURM cluster (``bash scripts/slurm-up.sh``, then ``source
/tmp/nbddp-slurm/env``) whose nodes share this filesystem.
Writes its record (``_record.py``) under ``benchmarks/results/``.
Run: ``python benchmarks/bench_slurm_session.py [--repeats N] [--nodes N] [--noisy]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from _record import Record, add_options
from bench_launch import HERE, alternate, summary
from bench_session import run_cell, time_cells
from bench_slurm import NPROCS, plain_sbatch, run_plain

import nbddp
from nbddp._run.config import RunConfig
from nbddp._run.groups.shape import rank_environment

START_TARGET = 1.2
ROUND_TRIP_TARGET = 0.020
ARGUMENT_TARGET = 1e9


def start_session(nodes: int) -> tuple[float, Any]:
    """Seconds from ``Session(...)`` to every rank ready; the world size, checked by one
    all-reduce (outside the timing: the plain job's all-reduce is part of its start)."""
    start = time.perf_counter()
    with nbddp.Session(NPROCS, cluster=nbddp.Slurm(nodes=nodes), output="none") as session:
        elapsed = time.perf_counter() - start
        value = session.run(_world_sum)
    return elapsed, value


def _world_sum() -> float:
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    return float(value.item())


def kernel_figures(nodes: int, repeats: int, gib: float) -> dict[str, list[float]]:
    """Round trips of a trivial cell, a plain cell and a cell that reads ``gib`` GiB."""
    from jupyter_client.manager import start_new_kernel

    elements = int(gib * 2**30) // 4
    cells = {"plain cell": "1 + 1", "%%ddp noop": "%%ddp\nNone",
             "%%ddp large argument": "%%ddp\nint(big.numel())",
             "%%ddp large result": "%%ddp --out back\nback = big"}
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-", dir=HERE) as cwd:
        manager, client = start_new_kernel(kernel_name="python3", cwd=cwd)
        try:
            run_cell(client, f"%load_ext nbddp\nimport torch\nbig = torch.ones({elements})\n"
                             f"%ddp_session start --slurm --nodes {nodes} --nprocs {NPROCS}",
                     300)
            times = time_cells(client, cells, repeats, warm_up=3, timeout=300)
            run_cell(client, "%ddp_session stop", 120)
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=False)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="session starts (default 5)")
    parser.add_argument("--cells", type=int, default=50, help="cell round trips (default 50)")
    parser.add_argument("--nodes", type=int, default=2, help="nodes per job (default 2)")
    parser.add_argument("--gib", type=float, default=1.0, help="the argument's GiB (default 1)")
    add_options(parser)
    opts = parser.parse_args()
    record = Record.start("slurm_session", opts)
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-slurm-", dir=HERE) as name:
        tmp = Path(name)
        os.environ["NBDDP_RUNS_DIR"] = str(tmp / "runs")  # on the nodes' shared filesystem
        env = rank_environment(RunConfig(nprocs=NPROCS))
        script = plain_sbatch(tmp, opts.nodes)
        print(f"session start vs plain sbatch + torchrun on {opts.nodes} nodes: "
              f"{opts.repeats} runs each ", end="", flush=True)
        nb, plain = alternate(opts.repeats, partial(start_session, opts.nodes),
                              partial(run_plain, tmp, env, script))
        print(f"\n%%ddp cells through a kernel: {opts.cells} round trips each", flush=True)
        cells = kernel_figures(opts.nodes, opts.cells, opts.gib)
    world = float(NPROCS * opts.nodes)
    if {v for _, v in nb + plain} != {world}:
        raise RuntimeError(f"all_reduce gave a wrong sum: {nb + plain}")
    start = summary([t for t, _ in nb], [t for t, _ in plain], START_TARGET, False)
    medians = {cell: statistics.median(values) for cell, values in cells.items()}
    moved = opts.gib * 2**30 / max(medians["%%ddp large argument"] - medians["%%ddp noop"], 1e-9)
    back = opts.gib * 2**30 / max(medians["%%ddp large result"]
                                  - medians["%%ddp large argument"], 1e-9)
    print(f"\n{opts.nodes} nodes x {NPROCS} CPU ranks:{record.label}")
    print(f"  session start {start['nbddp_median']:.2f} s vs plain job "
          f"{start['torchrun_median']:.2f} s: ratio {start['ratio']:.3f} (target "
          f"<= {START_TARGET}: {'met' if start['met'] else 'MISSED'})")
    for cell, value in medians.items():
        print(f"  {cell:24}{value * 1000:9.1f} ms median")
    print(f"  trivial cell target <= {ROUND_TRIP_TARGET * 1000:.0f} ms: "
          f"{'met' if medians['%%ddp noop'] <= ROUND_TRIP_TARGET else 'MISSED'}")
    print(f"  {opts.gib:g} GiB argument: {moved / 1e9:.2f} GB/s (target >= "
          f"{ARGUMENT_TARGET / 1e9:g} GB/s: {'met' if moved >= ARGUMENT_TARGET else 'MISSED'})")
    print(f"  {opts.gib:g} GiB result: {back / 1e9:.2f} GB/s")
    record.write({"nodes": opts.nodes, "nprocs_per_node": NPROCS,
                           "start_wall_s": start, "cells_s": cells, "medians_s": medians,
                           "argument_bytes_per_s": moved, "result_bytes_per_s": back})


if __name__ == "__main__":
    main()
