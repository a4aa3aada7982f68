"""Benchmark a session's call against Monarch's, side by side in one process.

A trivial call on N CPU ranks (2; ``--ranks 2 4 8``: each count in turn) that keep their
state, each with a gloo process group: ``nbddp.Session.run`` against a Monarch actor
endpoint (``mesh.noop.call().get()``), each of a no-op and of one all-reduce. nbddp's
no-op is timed twice: defined here, in ``__main__`` as a notebook's function is, which
``Session.run`` pickles by value with every call (``nbddp noop``), and imported from a
module the ranks import too (``nbddp noop imported``), pickled by reference as the
all-reduce is: like a Monarch endpoint, whose code the actors hold from their start. A
third pair, ``torch_step``, is one small tensor op in a function of ``__main__`` that
uses ``torch``, as a notebook's training step does (what a call by value costs grows
with what the function's code reaches: cloudpickle looks for the submodules it uses).

Both sides' ranks stay up for the whole run and are called in alternating blocks, so
that a machine whose speed drifts (as a shared virtual machine's does) slows both alike.
Every other round runs the blocks in reverse order: a block pays for what the one before
it left running (a Monarch all-reduce block leaves its processes busy for a while), and
in one fixed order the same side always followed it. Then the same through a real
Jupyter kernel, as a person meets it (unless ``--calls-only``): ``%%ddp`` session cells
and cells that await the Monarch endpoints (a no-op, the tensor op, an all-reduce;
neither side shows a value), each timed from the execute request to the kernel going
idle, in a new random order every round (a cell's time depends on the one before it: one
that kept both cores busy leaves them quick to wake), with a plain cell (``x = 1 + 1``:
no value shown either) whose time is taken off: a cell's own time. Medians of every call
and the ratio nbddp / Monarch are printed, each ratio of calls and of cells with its 95%
interval (a bootstrap over the rounds): a side is ahead only where all of the interval
is. The record (``_record.py``, under ``benchmarks/results/``) keeps every sample.

Needs Monarch (``pip install torchmonarch``, with the same torch); without it, this says
so and exits 0. Run: ``python benchmarks/bench_session_peer.py [--ranks N ...]
[--rounds N] [--calls-only] [--noisy] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo, even on a GPU machine
os.environ["NBDDP_STANDBY"] = "0"  # nothing starting in the background while timing

import torch  # noqa: E402
import torch.nn.functional  # noqa: E402,F401 - (imported in the kernel, as a notebook's)
from _record import Record, add_options  # noqa: E402
from _workloads import allreduce_once  # noqa: E402 - (ranks find it: see bench_launch)
from _workloads import noop as imported_noop  # noqa: E402
from bench_session import run_cell, time_cells  # noqa: E402

import nbddp  # noqa: E402

NPROCS = 2  # ranks, unless --ranks says otherwise
BLOCK = 20  # calls of one side before the other's turn
TARGET = 0.001  # seconds, the median of a trivial Session.run: at most
CELL_TARGET = 0.002  # seconds, a trivial %%ddp session cell's own time: at most
RESAMPLES = 2000  # bootstrap draws for each ratio's interval


def noop() -> None:
    """The trivial call (a function of ``__main__``: pickled by value)."""


def torch_step() -> float:
    """One small tensor op, in a function of ``__main__`` that uses torch."""
    return float(torch.nn.functional.relu(torch.ones(4)).sum().item())


def monarch_ranks(nprocs: int = NPROCS) -> tuple[Any, Any]:
    """``nprocs`` Monarch processes, each an actor in a gloo process group; (procs, actors)."""
    from monarch.actor import Actor, current_rank, endpoint, this_host

    class Ranks(Actor):
        def __init__(self, port: int) -> None:
            import torch.distributed as dist

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=current_rank().rank, world_size=nprocs)

        @endpoint
        def noop(self) -> None:
            return None

        @endpoint
        def allreduce(self) -> float:
            return allreduce_once()

        @endpoint
        def torch_step(self) -> float:
            return torch_step()

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = this_host().spawn_procs(per_host={"procs": nprocs})
    actors = procs.spawn("ranks", Ranks, port)
    actors.noop.call().get()
    return procs, actors


def timed(call: Callable[[], object], times: list[float]) -> None:
    for _ in range(BLOCK):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)


def side_by_side(rounds: int, nprocs: int = NPROCS) -> dict[str, list[float]]:
    """Alternating blocks of each call on both sides, after a warm-up."""
    procs, actors = monarch_ranks(nprocs)
    try:
        with nbddp.Session(nprocs, output="none") as session:
            calls: dict[str, Callable[[], object]] = {
                "nbddp noop": lambda: session.run(noop),
                "nbddp noop imported": lambda: session.run(imported_noop),
                "monarch noop": lambda: actors.noop.call().get(),
                "nbddp all_reduce": lambda: session.run(allreduce_once),
                "monarch all_reduce": lambda: actors.allreduce.call().get(),
                "nbddp torch_step": lambda: session.run(torch_step),
                "monarch torch_step": lambda: actors.torch_step.call().get(),
            }
            times: dict[str, list[float]] = {name: [] for name in calls}
            for call in calls.values():
                timed(call, [])
            order = list(calls.items())
            for round_ in range(rounds):
                for name, call in order if round_ % 2 == 0 else order[::-1]:
                    timed(call, times[name])
    finally:
        procs.stop().get()
    return times


KERNEL_CELLS = {
    "plain cell": "x = 1 + 1",
    "%%ddp noop": "%%ddp\nNone",
    "monarch noop cell": "_ = await actors.noop.call()",
    "%%ddp torch_step": "%%ddp\nx = float(torch.nn.functional.relu(torch.ones(4)).sum().item())",
    "monarch torch_step cell": "_ = await actors.torch_step.call()",
    "%%ddp all_reduce": "%%ddp\nt = torch.ones(1)\ndist.all_reduce(t)\nx = float(t.item())",
    "monarch all_reduce cell": "_ = await actors.allreduce.call()",
}
"""Each side's cells as a notebook's user writes them, showing no value. A Monarch cell
awaits its call, as Monarch asks inside a running event loop (the kernel's): there
``.get()`` warns on stderr with every call."""
CELL_PAIRS = {"noop": ("%%ddp noop", "monarch noop cell"),
              "torch_step": ("%%ddp torch_step", "monarch torch_step cell"),
              "all_reduce": ("%%ddp all_reduce", "monarch all_reduce cell")}
"""The cells compared: nbddp's, Monarch's."""
SESSION_IMPORTS = ("%%ddp\nimport torch\nimport torch.nn.functional\n"
                   "import torch.distributed as dist")


def in_kernel(cells: int, nprocs: int = NPROCS) -> dict[str, list[float]]:
    """Each of ``KERNEL_CELLS`` ``cells`` times, alternated, in one kernel that holds an
    nbddp session and a Monarch mesh, after a warm-up; seconds per cell."""
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3", cwd=str(Path(__file__).parent))
    try:
        run_cell(client, "from bench_session_peer import monarch_ranks\n"
                         f"procs, actors = monarch_ranks({nprocs})\n"
                         f"%load_ext nbddp\n%ddp_session start --nprocs {nprocs}", 600)
        run_cell(client, SESSION_IMPORTS, 120)
        times = time_cells(client, KERNEL_CELLS, cells, warm_up=10, shuffled=True)
        run_cell(client, "%ddp_session stop\nprocs.stop().get()", 60)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[NPROCS],
                        help=f"rank counts, each in turn (default {NPROCS})")
    parser.add_argument("--rounds", type=int, default=15,
                        help=f"blocks of {BLOCK} calls per side and call (default 15)")
    parser.add_argument("--calls-only", action="store_true",
                        help="the calls from this process alone, not the kernel's cells")
    add_options(parser)
    opts = parser.parse_args()
    try:
        import monarch.actor  # noqa: F401
    except ImportError:
        print("Monarch is not installed (pip install torchmonarch): nothing to compare")
        return 0
    record = Record.start("session_peer", opts)
    figures = {str(nprocs): one_count(nprocs, opts, record.label) for nprocs in opts.ranks}
    if len(figures) > 1:
        for ratio in next(iter(figures.values()))["ratios"]:
            print(f"\n{ratio}, nbddp / Monarch, by ranks: " + ", ".join(
                f"{n}: {f['ratios'][ratio]:.2f}" + _within(f["intervals_95"].get(ratio))
                for n, f in figures.items()))
    record.write({"block": BLOCK, "rounds": opts.rounds,
                  "python": platform.python_version(), "cpus": os.cpu_count(),
                  "by_ranks": figures})
    return 0


def one_count(nprocs: int, opts: argparse.Namespace, label: str = "") -> dict[str, Any]:
    """Both sides at ``nprocs`` ranks, side by side; the figures printed and returned."""
    load = os.getloadavg()[0]
    times = side_by_side(opts.rounds, nprocs)
    if not opts.calls_only:
        times.update(in_kernel(opts.rounds * BLOCK, nprocs))
    medians = {name: statistics.median(values) for name, values in times.items()}
    pairs = {call: (f"nbddp {call}", f"monarch {call}", BLOCK)
             for call in ("noop", "all_reduce", "torch_step")}
    pairs["noop imported"] = ("nbddp noop imported", "monarch noop", BLOCK)
    ratios = {name: medians[ours] / medians[theirs] for name, (ours, theirs, _) in pairs.items()}
    if not opts.calls_only:
        for call, (ours, theirs) in CELL_PAIRS.items():
            for name in (ours, theirs):
                medians[f"{name} - plain cell"] = medians[name] - medians["plain cell"]
            ratios[f"{call} cell's own time"] = (medians[f"{ours} - plain cell"]
                                                 / medians[f"{theirs} - plain cell"])
            ratios[f"{call} cell"] = medians[ours] / medians[theirs]
            pairs[f"{call} cell"] = (ours, theirs, 1)
    intervals = {name: ratio_interval(times[ours], times[theirs], per_round)
                 for name, (ours, theirs, per_round) in pairs.items()}
    print(f"\nnbddp Session.run vs a Monarch endpoint call, {nprocs} CPU ranks (gloo), "
          f"median of {opts.rounds * BLOCK}; {os.cpu_count()} CPUs, load {load:.2f} -> "
          f"{os.getloadavg()[0]:.2f}{label}")
    for name, value in medians.items():
        print(f"  {name:32}{value * 1000:8.3f} ms")
    for call, ratio in ratios.items():
        low_high = intervals.get(call)
        said = "" if low_high is None else (
            f"  (95%: {low_high[0]:.2f}-{low_high[1]:.2f}, {_verdict(*low_high)})")
        print(f"  {call}: nbddp / monarch {ratio:.2f}{said}")
    figures: dict[str, Any] = {
        "loadavg_1min": {"start": load, "end": os.getloadavg()[0]},
        "times_s": times, "medians_s": medians, "ratios": ratios,
        "intervals_95": intervals}
    if nprocs == NPROCS:  # (the targets are for the 2-rank session)
        figures["met"] = met = medians["nbddp noop"] <= TARGET
        print(f"trivial Session.run: {medians['nbddp noop'] * 1000:.2f} ms, target <= "
              f"{TARGET * 1000:.0f} ms: {'met' if met else 'MISSED'}", flush=True)
        if not opts.calls_only:
            own = medians["%%ddp noop - plain cell"]
            figures["cell_met"] = cell_met = own <= CELL_TARGET
            print(f"trivial %%ddp session cell's own time: {own * 1000:.2f} ms, target <= "
                  f"{CELL_TARGET * 1000:.0f} ms: {'met' if cell_met else 'MISSED'}",
                  flush=True)
    return figures


def ratio_interval(ours: list[float], theirs: list[float], per_round: int,
                   resamples: int = RESAMPLES) -> tuple[float, float]:
    """The 95% interval of median(ours) / median(theirs), by a bootstrap over rounds:
    each round gave ``per_round`` samples of each side in the same minutes (a block of
    calls, or one cell each in its shuffled order), so a round is drawn whole, both
    sides together, and the machine's drift between rounds stays in the interval."""
    rounds = [(ours[i:i + per_round], theirs[i:i + per_round])
              for i in range(0, min(len(ours), len(theirs)), per_round)]
    draw = random.Random(0).choices
    ratios = []
    for _ in range(resamples):
        drawn = draw(rounds, k=len(rounds))
        ratios.append(statistics.median([t for mine, _ in drawn for t in mine])
                      / statistics.median([t for _, other in drawn for t in other]))
    ratios.sort()
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def _within(interval: tuple[float, float] | None) -> str:
    return "" if interval is None else f" ({interval[0]:.2f}-{interval[1]:.2f})"


def _verdict(low: float, high: float) -> str:
    """Who is ahead, by the interval: only where all of it lies on one side of 1."""
    return "nbddp ahead" if high < 1 else "Monarch ahead" if low > 1 else "level"


if __name__ == "__main__":
    sys.exit(main())
