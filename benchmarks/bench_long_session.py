"""Benchmark a long day in one session: a cell's cost must not grow with the cells before it.

Through a real Jupyter kernel with a session of 2 CPU ranks (gloo), a few thousand mixed
``%%ddp`` cells in a row, as a long day of work sends them: most do an all-reduce and
``nbddp.log`` a step's loss; every 50th raises on rank 1 (the session keeps its state);
every 97th uses a fresh 64 MiB tensor from the notebook (it crosses through shared
memory). The cells are cut into blocks; per block it prints the median and 10th
percentile wall time of the all-reduce cells, as the client sees them, and the CPU time
per cell of the kernel and of the ranks (from ``/proc``: load from other processes does
not count). The last block against the first is the figure: 1.0 means no growth.
Writes its record (``_record.py``, every all-reduce cell's time) under
``benchmarks/results/``.
Run: ``python benchmarks/bench_long_session.py [--cells N] [--blocks B] [--noisy]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo, even on a GPU machine
os.environ["NBDDP_STANDBY"] = "0"  # nothing starting in the background while timing

from _record import Record, add_options  # noqa: E402

TARGET = 1.2  # last block / first block, median all-reduce cell and CPU per cell: at most
TICKS = os.sysconf("SC_CLK_TCK")

SETUP = """%%ddp
import torch, torch.distributed as dist, nbddp
step = 0
"""
STEP = """%%ddp
step += 1
t = torch.ones(1); dist.all_reduce(t)
nbddp.log(step=step, loss=1.0 / step)
"""


def cell_of_the_day(i: int) -> tuple[str, str, str | None]:
    """The ``i``-th cell: its kind, its code, and a plain cell to run before it."""
    if i % 97 == 96:
        return "64 MiB in", "%%ddp\nfloat(big[0])", f"big = torch.full((16 * 2**20,), {i}.0)"
    if i % 50 == 49:
        return "raises", f"%%ddp\nif dist.get_rank() == 1:\n    raise ValueError('{i}')", None
    return "all-reduce", STEP, None


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of ``pid`` so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def tree(root: int) -> set[int]:
    """``root``'s descendants (torchrun and the ranks, for a kernel)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


@dataclass
class Block:
    """One block of cells: the all-reduce cells' wall times, and CPU spent over it."""

    walls: list[float] = field(default_factory=list)
    cells: int = 0
    kernel_cpu: float = 0.0
    ranks_cpu: float = 0.0

    def figures(self) -> dict[str, float]:
        ordered = sorted(self.walls)
        return {"median_ms": statistics.median(ordered) * 1000,
                "p10_ms": ordered[len(ordered) // 10] * 1000,
                "kernel_cpu_ms_per_cell": self.kernel_cpu / self.cells * 1000,
                "ranks_cpu_ms_per_cell": self.ranks_cpu / self.cells * 1000}


def run_cell(client: Any, code: str, timeout: float = 60) -> str:
    """Execute ``code`` and wait until the kernel is idle; its status (ok or error)."""
    reply = client.execute_interactive(code, timeout=timeout, output_hook=lambda msg: None)
    return reply["content"]["status"]


def long_day(client: Any, kernel_pid: int, cells: int, blocks: int) -> list[Block]:
    """Run ``cells`` cells of the day, cut into ``blocks`` blocks."""
    per_block = cells // blocks
    measured: list[Block] = []
    ranks = tree(kernel_pid)
    for b in range(blocks):
        block = Block()
        kernel_before = cpu_seconds(kernel_pid)
        ranks_before = {pid: cpu_seconds(pid) for pid in ranks}
        for i in range(b * per_block, (b + 1) * per_block):
            kind, code, before = cell_of_the_day(i)
            if before is not None:
                run_cell(client, before)
            start = time.perf_counter()
            status = run_cell(client, code)
            if kind == "all-reduce":
                block.walls.append(time.perf_counter() - start)
            if status != ("error" if kind == "raises" else "ok"):
                raise RuntimeError(f"cell {i} ({kind}) ended {status}")
        block.cells = per_block
        block.kernel_cpu = cpu_seconds(kernel_pid) - kernel_before
        if tree(kernel_pid) != ranks:
            raise RuntimeError("the session's ranks were replaced: their CPU is not comparable")
        block.ranks_cpu = sum(cpu_seconds(pid) - was for pid, was in ranks_before.items())
        measured.append(block)
        print(f"  block {b + 1}/{blocks}: " + ", ".join(
            f"{name} {value:.2f}" for name, value in block.figures().items()), flush=True)
    return measured


def main() -> None:
    from jupyter_client.manager import start_new_kernel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=3000, help="cells in all (default 3000)")
    parser.add_argument("--blocks", type=int, default=6, help="blocks to compare (default 6)")
    add_options(parser)
    opts = parser.parse_args()
    record = Record.start("long_session", opts)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as cwd:
        os.environ["NBDDP_RUNS_DIR"] = str(Path(cwd) / "runs")  # keep the user's records
        manager, client = start_new_kernel(kernel_name="python3", cwd=cwd)
        try:
            for setup in ("import torch\n%load_ext nbddp\n%ddp_session start --nprocs 2",
                          SETUP):
                if run_cell(client, setup, 120) != "ok":
                    raise RuntimeError(f"setup failed: {setup}")
            print(f"{opts.cells} cells in {opts.blocks} blocks", flush=True)
            blocks = long_day(client, manager.provisioner.pid, opts.cells, opts.blocks)
            run_cell(client, "%ddp_session stop")
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=False)
    first, last = blocks[0].figures(), blocks[-1].figures()
    ratios = {name: last[name] / first[name] for name in first}
    result = {"cells": opts.cells, "blocks": [b.figures() for b in blocks],
              "block_walls_s": [b.walls for b in blocks],
              "last_over_first": ratios, "target": TARGET,
              "met": all(value <= TARGET for value in ratios.values()),
              "python": platform.python_version(), "cpus": os.cpu_count(),
              "loadavg_1min": {"start": load, "end": os.getloadavg()[0]}}
    print(f"\nlast block / first block ({opts.cells} cells, 2 CPU ranks; {os.cpu_count()} "
          f"CPUs, load {load:.2f} -> {os.getloadavg()[0]:.2f}){record.label}:")
    for name, value in ratios.items():
        print(f"  {name:26}{first[name]:8.2f} -> {last[name]:8.2f}   x{value:.2f}")
    print(f"target: each at most x{TARGET}: {'met' if result['met'] else 'MISSED'}")
    record.write(result)


if __name__ == "__main__":
    main()
