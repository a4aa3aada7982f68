"""A long day in one session, through a real kernel: a cell's cost does not grow with the
cells before it, and nothing goes wrong that should not.

Two thousand mixed ``%%ddp`` cells, as a day of work sends them: an all-reduce and a
logged step; every 50th raises on rank 1 (the session keeps its state); every 97th uses
a fresh 64 MiB tensor from the notebook. Compared: the CPU time per cell of the kernel and
the ranks (from ``/proc``, which the other lane's load does not inflate the way it does
wall time) in the first and the last block. ``benchmarks/bench_long_session.py`` gives
the figures, wall time included.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .test_session import cell, kernel_with_session, session_pids

pytestmark = pytest.mark.slow

CELLS = int(os.environ.get("NBDDP_LONG_DAY_CELLS", "2000"))
BLOCK = CELLS // 5
TICKS = os.sysconf("SC_CLK_TCK")

STEP = """
step += 1
t = torch.ones(1); dist.all_reduce(t)
nbddp.log(step=step, loss=1.0 / step)
"""


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU time of ``pids`` so far."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / TICKS


def test_a_cells_cost_does_not_grow_over_a_long_day(tmp_path):
    with kernel_with_session(tmp_path) as kernel:
        ranks = sorted(session_pids(kernel).values())
        everyone = [kernel.pid, *ranks]
        kernel.run("import torch").assert_ok()
        cell(kernel, "import torch, torch.distributed as dist, nbddp\nstep = 0").assert_ok()
        per_cell = []
        for first in range(0, BLOCK * 5, BLOCK):
            spent = cpu_seconds(everyone)
            for i in range(first, first + BLOCK):
                if i % 97 == 96:
                    kernel.run(f"big = torch.full((16 * 2**20,), {i}.0)").assert_ok()
                    assert cell(kernel, "float(big[0])").assert_ok().result() == f"{i}.0"
                elif i % 50 == 49:
                    run = cell(kernel, f"if dist.get_rank() == 1:\n    raise ValueError('{i}')")
                    assert f"rank 1 raised ValueError: {i}" in run.error_text(), run.describe()
                    assert "back at rest, with their state" in run.error_text()
                else:
                    cell(kernel, STEP).assert_ok()
            per_cell.append((cpu_seconds(everyone) - spent) / BLOCK)
        assert cell(kernel, "step").assert_ok().result() == str(
            sum(1 for i in range(BLOCK * 5) if i % 97 != 96 and i % 50 != 49))
        assert sorted(session_pids(kernel).values()) == ranks  # the same ranks all day
    shown = ", ".join(f"{seconds * 1000:.2f}" for seconds in per_cell)
    assert per_cell[-1] <= 1.5 * per_cell[0] + 0.001, f"CPU ms per cell by block: {shown}"
