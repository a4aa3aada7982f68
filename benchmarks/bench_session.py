"""Benchmark a session's round trip: a trivial cell on ranks that keep their state.

Measures, on 2 CPU ranks (gloo), the wall time of a trivial run on an open session:
(1) ``Session.run`` from Python, and (2) a ``%%ddp`` cell through a real Jupyter kernel,
timed by the client from the execute request to the kernel going idle, as a person sees
it, with a plain Python cell's round trip in the same kernel for reference. Both are
alternated with a trivial all-reduce cell, which adds one collective; and (3) the first
``nbddp.launch`` of a fresh kernel, a few seconds after ``import nbddp``, with standby on
(ranks start as nbddp loads) and off. Medians are printed; the record (``_record.py``,
under ``benchmarks/results/``) keeps every sample.
Run: ``python benchmarks/bench_session.py [--repeats N] [--noisy] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo, even on a GPU machine
os.environ["NBDDP_STANDBY"] = "0"  # nothing starting in the background while timing

from _record import Record, add_options  # noqa: E402

import nbddp  # noqa: E402

TARGET = 0.020  # seconds, median round trip of a trivial cell: at most
OWN_TARGET = 0.002  # seconds, its own time (the round trip less a plain cell's): at most
NPROCS = 2


def noop() -> None:
    """The trivial run."""


def allreduce_once() -> float:
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    return float(value.item())


IDLE_GAP = 0.010
"""Seconds every process sits idle before a call in the ``noop after idle`` figure: about
a person's quickest pace, and more than a kernel's gap between two cells. A machine
whose cores went idle takes longer to wake every process a call needs; in a kernel, each
cell meets that."""


def python_round_trips(repeats: int) -> dict[str, list[float]]:
    """``Session.run`` of a no-op and of one all-reduce, alternated, after a warm-up; and
    of a no-op after ``IDLE_GAP`` s of rest."""
    times: dict[str, list[float]] = {"noop": [], "allreduce": [], "noop after idle": []}
    with nbddp.Session(NPROCS, output="none") as session:
        for _ in range(5):
            session.run(noop)
        for _ in range(repeats):
            for name, fn in (("noop", noop), ("allreduce", allreduce_once)):
                start = time.perf_counter()
                session.run(fn)
                times[name].append(time.perf_counter() - start)
        for _ in range(repeats):
            time.sleep(IDLE_GAP)
            start = time.perf_counter()
            session.run(noop)
            times["noop after idle"].append(time.perf_counter() - start)
    return times


def kernel_round_trips(repeats: int) -> dict[str, list[float]]:
    """A ``%%ddp`` cell on a session, and a plain cell, timed by a Jupyter client."""
    from jupyter_client.manager import start_new_kernel

    cells = {"plain cell": "1 + 1",
             "%%ddp noop": "%%ddp\nNone",
             "%%ddp all_reduce": "%%ddp\nimport torch, torch.distributed as dist\n"
                                 "t = torch.ones(1); dist.all_reduce(t); float(t)"}
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as cwd:
        manager, client = start_new_kernel(kernel_name="python3", cwd=cwd)
        try:
            run_cell(client, "%load_ext nbddp\n%ddp_session start --nprocs 2", 120)
            times = time_cells(client, cells, repeats, warm_up=5)
            run_cell(client, "%ddp_session autoreload on")  # the ranks look at the user's
            times.update(time_cells(  # modules' files before each cell
                client, {"%%ddp noop, autoreload on": cells["%%ddp noop"]}, repeats,
                warm_up=0))
            run_cell(client, "%ddp_session stop")
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=False)
    return times


FIRST_CELL_AFTER = 8.0
"""Seconds between ``import nbddp`` and the first launch: a person writing the first cell
(long enough for two ranks to import torch on a busy 2-core machine)."""


def first_launches(repeats: int) -> dict[str, list[float]]:
    """The first ``nbddp.launch`` of a fresh kernel, ``FIRST_CELL_AFTER`` s after
    ``import nbddp``: with standby on (ranks started as nbddp loads) and off (cold)."""
    from jupyter_client.manager import start_new_kernel

    times: dict[str, list[float]] = {"first launch, warm-up on": [],
                                     "first launch, standby off": []}
    for _ in range(repeats):
        for name, standby in (("first launch, warm-up on", "1"),
                              ("first launch, standby off", "0")):
            env = {**os.environ, "NBDDP_STANDBY": standby}
            with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as cwd:
                manager, client = start_new_kernel(kernel_name="python3", cwd=cwd, env=env)
                try:
                    run_cell(client, "import nbddp\ndef noop(): pass")
                    time.sleep(FIRST_CELL_AFTER)
                    start = time.perf_counter()
                    run_cell(client, "nbddp.launch(noop, nprocs=2)", 120)
                    times[name].append(time.perf_counter() - start)
                finally:
                    client.stop_channels()
                    manager.shutdown_kernel(now=False)
    return times


def run_cell(client: Any, code: str, timeout: float = 60) -> None:
    """Execute ``code`` in the client's kernel and wait until it is idle again."""
    reply = client.execute_interactive(code, timeout=timeout, output_hook=lambda msg: None)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"the cell failed: {reply['content']}")


def time_cells(client: Any, cells: dict[str, str], repeats: int, warm_up: int,
               timeout: float = 60, shuffled: bool = False) -> dict[str, list[float]]:
    """Each of ``cells`` (name: code) ``repeats`` times, alternated, after ``warm_up``
    untimed rounds: seconds from the execute request to the kernel going idle.
    ``shuffled``: each round in its own order (seeded), so that no cell always follows
    the same one (a cell after one that kept both cores busy starts on warm ones)."""
    for _ in range(warm_up):
        for code in cells.values():
            run_cell(client, code, timeout)
    times: dict[str, list[float]] = {name: [] for name in cells}
    order, shuffle = list(cells.items()), random.Random(0).shuffle
    for _ in range(repeats):
        if shuffled:
            shuffle(order)
        for name, code in order:
            start = time.perf_counter()
            run_cell(client, code, timeout)
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=100, help="round trips each")
    parser.add_argument("--first", type=int, default=3,
                        help="fresh kernels per first-launch measurement (default 3)")
    add_options(parser)
    opts = parser.parse_args()
    record = Record.start("session", opts)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as tmp:
        os.environ["NBDDP_RUNS_DIR"] = str(Path(tmp) / "runs")  # keep the user's records
        print(f"Session.run: {opts.repeats} round trips each", flush=True)
        python = python_round_trips(opts.repeats)
        print(f"%%ddp cells through a kernel: {opts.repeats} round trips each", flush=True)
        kernel = kernel_round_trips(opts.repeats)
        print(f"first launch in a fresh kernel: {opts.first} kernels each", flush=True)
        first = first_launches(opts.first)
    medians = {name: statistics.median(v) for name, v in {**python, **kernel, **first}.items()}
    medians["%%ddp noop - plain cell"] = medians["%%ddp noop"] - medians["plain cell"]
    result = {"nprocs": NPROCS, "repeats": opts.repeats, "python": platform.python_version(),
              "cpus": os.cpu_count(), "loadavg_1min": {"start": load, "end": os.getloadavg()[0]},
              "target_s": TARGET, "session_run_s": python, "kernel_cell_s": kernel,
              "first_launch_s": first,
              "medians_s": medians, "met": medians["%%ddp noop"] <= TARGET,
              "own_target_s": OWN_TARGET,
              "own_met": medians["%%ddp noop - plain cell"] <= OWN_TARGET}
    print(f"\nsession round trips, {NPROCS} CPU ranks (gloo), median of {opts.repeats}; "
          f"{os.cpu_count()} CPUs, load {load:.2f} -> {os.getloadavg()[0]:.2f}{record.label}")
    for name, value in medians.items():
        print(f"  {name:28}{value * 1000:8.1f} ms")
    print(f"trivial %%ddp cell: {medians['%%ddp noop'] * 1000:.1f} ms, target <= "
          f"{TARGET * 1000:.0f} ms: {'met' if result['met'] else 'MISSED'}")
    print(f"its own time (less a plain cell's): "
          f"{medians['%%ddp noop - plain cell'] * 1000:.2f} ms, target <= "
          f"{OWN_TARGET * 1000:.0f} ms: {'met' if result['own_met'] else 'MISSED'}")
    record.write(result)


if __name__ == "__main__":
    main()
