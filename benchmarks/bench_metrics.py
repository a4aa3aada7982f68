"""Benchmark nbddp's metrics and output path on 2 CPU ranks, inside real launched runs.

Measures (1) the cost of one ``nbddp.log(step=i, loss=x, acc=y)`` call on a rank, with
Python floats and with 0-d tensors, timed in a tight loop; (2) the steps/s of the DDP MLP
loop of ``bench_launch.py`` with ``nbddp.log`` every step versus without (alternating
launches, medians), and iterated through ``nbddp.progress`` (whose step clock splits each
rank's step time for the panel) versus a plain ``range`` (paired blocks in one run); (3)
the latency from a rank-0 ``print`` to the kernel receiving it,
with the ranks idle and while they train. Everything runs under ``nbddp.launch``.
Writes its record (``_record.py``) under ``benchmarks/results/``.
Run: ``python benchmarks/bench_metrics.py [--repeats N] [--noisy] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import _workloads
import torch
from _record import Record, add_options

# Importing bench_launch also puts this folder on the ranks' PYTHONPATH and hides GPUs
# from the ranks (os.environ), as its own runs have it.
from bench_launch import NPROCS, TIMEOUT, alternate, run_nbddp

import nbddp
from nbddp._wire.history import STALE_SECONDS

LOG_TARGET_US = 20.0  # one nbddp.log call on a rank: at most
STEPS_TARGET = 0.98  # steps/s with nbddp.log every step / without: at least
CLOCK_TARGET = 0.99  # steps/s through nbddp.progress (its step clock) / plain: at least
LATENCY_TARGET_MS = 100.0  # rank-0 print -> kernel, median: at most
LINE = re.compile(re.escape(_workloads.MARK) + r" (idle|busy) (\d+) (\d+\.\d+)")


class LineClock:
    """Stands in for ``sys.stdout`` while nbddp launches: keeps every line nbddp writes
    there, with the ``time.time()`` at which the line's last piece arrived."""

    encoding = "utf-8"

    def __init__(self) -> None:
        self.lines: list[tuple[str, float]] = []
        self._partial = ""

    def write(self, text: str) -> int:
        now = time.time()
        *complete, self._partial = (self._partial + text).split("\n")
        self.lines.extend((line, now) for line in complete)
        return len(text)

    def flush(self) -> None:
        """Nothing is buffered."""

    def isatty(self) -> bool:
        return False


@contextmanager
def captured() -> Iterator[LineClock]:
    """Replace ``sys.stdout`` (which ``launch`` hands to the run's panel) with a LineClock."""
    saved, clock = sys.stdout, LineClock()
    sys.stdout = clock
    try:
        yield clock
    finally:
        sys.stdout = saved


def quiet(run: Callable[[], tuple[float, Any]]) -> tuple[float, Any]:
    """One ``run_nbddp`` whose panel (progress bar, summary line) goes nowhere."""
    with captured():
        return run()


def measure_log_cost(calls: int) -> dict[str, Any]:
    """One launch whose ranks time ``calls`` calls of ``nbddp.log`` per kind of value."""
    start, cpu = time.perf_counter(), time.process_time()
    with captured():
        job = nbddp.launch(_workloads.log_call_cost, nprocs=NPROCS, args=(calls,),
                           backend="gloo", timeout=TIMEOUT, all_ranks=True, wait=False)
        per_rank = job.result()
    wall, kernel_cpu = time.perf_counter() - start, time.process_time() - cpu
    history = job.history  # what the kernel made of the records: one row per step, ideally
    kernel = {"logged_steps": 2 * calls, "rows": len(history),
              "distinct_steps": len({row["step"] for row in history}),
              "rows_over_every_rank": sum(1 for row in history if row["ranks"] == NPROCS)}
    out: dict[str, Any] = {"calls": calls, "launch_wall_s": wall, "kernel_cpu_s": kernel_cpu,
                           "per_rank": per_rank, "kernel_history": kernel}
    for key in per_rank[0]:
        out[key] = max(r[key] for r in per_rank)  # the slower rank's figure
    out["target_us"] = f"<= {LOG_TARGET_US:g}"
    out["met"] = max(out["float_us"], out["tensor_us"]) <= LOG_TARGET_US
    return out


def measure_training(repeats: int, steps: int, warmup: int) -> dict[str, Any]:
    """Steps/s of the MLP loop with ``nbddp.log`` every step and without, alternating."""
    with_log = partial(quiet, partial(run_nbddp, _workloads.train_mlp, steps, warmup, 1))
    without = partial(quiet, partial(run_nbddp, _workloads.train_mlp, steps, warmup, 0))
    logged, plain = alternate(repeats, with_log, without)
    w, wo = [v["steps_per_s"] for _, v in logged], [v["steps_per_s"] for _, v in plain]
    w_med, wo_med = statistics.median(w), statistics.median(wo)
    _, paired = quiet(partial(run_nbddp, _workloads.train_mlp_paired, 4 * repeats,
                              steps // 2, warmup))
    paired_ratio = (statistics.median(paired["with_log"])
                    / statistics.median(paired["without_log"]))
    _, clocked = quiet(partial(run_nbddp, _workloads.train_mlp_clock_paired, 4 * repeats,
                               steps))
    clock_ratio = statistics.median(clocked["with_clock"]) / statistics.median(clocked["plain"])
    progress_us, plain_us = clocked.pop("loop_us")
    step_us = 1e6 / statistics.median(clocked["plain"])
    return {"steps": steps, "warmup": warmup, "with_log": w, "without_log": wo,
            "clock_ratio": clock_ratio, "clock_blocks": clocked,
            "progress_loop_us": progress_us, "plain_loop_us": plain_us, "step_us": step_us,
            "clock_share": (progress_us - plain_us) / step_us,
            "paired_ratio": paired_ratio, "paired_blocks": paired,
            "with_log_median": w_med, "without_log_median": wo_med, "ratio": w_med / wo_med,
            "target": f">= {STEPS_TARGET:.2f}", "met": w_med / wo_med >= STEPS_TARGET,
            "threads_per_rank": logged[0][1]["threads"]}


def measure_latency(count: int, interval_ms: int) -> dict[str, Any]:
    """One launch: rank 0 prints timestamped lines; note when each reaches sys.stdout."""
    with captured() as clock:
        wall, value = run_nbddp(_workloads.print_timestamps, count, interval_ms)
    received: dict[str, list[float]] = {"idle": [], "busy": []}
    for line, arrived in clock.lines:
        if match := LINE.search(line):
            received[match[1]].append((arrived - float(match[3])) * 1000)
    out: dict[str, Any] = {"prints": count, "interval_ms": interval_ms, "launch_wall_s": wall,
                           "busy_steps": value["busy_steps"]}
    for phase, ms in received.items():
        if len(ms) != count:
            raise RuntimeError(f"{phase}: {len(ms)} of {count} printed lines reached the kernel")
        out[phase] = {"latency_ms": ms, "median_ms": statistics.median(ms),
                      "p90_ms": statistics.quantiles(ms, n=10, method="inclusive")[8],
                      "max_ms": max(ms), "target": f"median <= {LATENCY_TARGET_MS:g}",
                      "met": statistics.median(ms) <= LATENCY_TARGET_MS}
    return out


def main() -> None:
    """Parse options, run the three measurements, print the table, write JSON if asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5,
                        help="training runs with and without nbddp.log (default 5)")
    parser.add_argument("--steps", type=int, default=500, help="timed training steps (500)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed training steps first")
    parser.add_argument("--calls", type=int, default=200_000,
                        help="nbddp.log calls timed per kind of value (200000)")
    parser.add_argument("--prints", type=int, default=50, help="timestamped prints per phase")
    parser.add_argument("--interval-ms", type=int, default=50,
                        help="mean time between prints (50); each gap is 0.5x to 1.5x this")
    add_options(parser)
    opts = parser.parse_args()
    if min(opts.repeats, opts.steps, opts.calls) < 1 or opts.prints < 2 or \
            min(opts.warmup, opts.interval_ms) < 0:
        parser.error("--repeats, --steps and --calls must be at least 1, --prints at least 2, "
                     "--warmup and --interval-ms at least 0")
    record = Record.start("metrics", opts)
    load_start = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as tmp:
        # The runs' records (logs, metrics history) go here, not to ~/.cache/nbddp/runs,
        # and are removed at the end with everything else.
        os.environ["NBDDP_RUNS_DIR"] = str(Path(tmp) / "runs")
        os.environ["TMPDIR"] = tempfile.tempdir = tmp
        print(f"nbddp.log cost: {opts.calls} calls per kind, 1 run", flush=True)
        log_cost = measure_log_cost(opts.calls)
        print(f"DDP MLP training with/without nbddp.log: {opts.repeats} runs each ", end="",
              flush=True)
        train = measure_training(opts.repeats, opts.steps, opts.warmup)
        print(f"print -> kernel latency: {opts.prints} prints per phase, 1 run", flush=True)
        latency = measure_latency(opts.prints, opts.interval_ms)
    result = {
        "nprocs": NPROCS, "repeats": opts.repeats, "torch": torch.__version__,
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "loadavg_1min": {"start": load_start, "end": os.getloadavg()[0]},
        "total_s": time.perf_counter() - started,
        "log_call": log_cost, "train_steps_per_s": train, "print_latency": latency,
    }
    print_table(result, record.label)
    record.write(result)


def print_table(r: dict, label: str = "") -> None:
    """Print the figures next to their targets."""
    log, train, lat = r["log_call"], r["train_steps_per_s"], r["print_latency"]

    def verdict(met: bool) -> str:
        return "met" if met else "MISSED"

    print(f"\nnbddp metrics and output: {r['nprocs']} CPU ranks (gloo); torch {r['torch']}, "
          f"{r['cpus']} CPUs, {train['threads_per_rank']:.0f} threads per rank, "
          f"load {r['loadavg_1min']['start']:.2f} -> {r['loadavg_1min']['end']:.2f}, "
          f"{r['total_s']:.0f} s in all{label}")
    print(f"{'':44}{'value':>10}  target")
    rows = [
        ("nbddp.log call, floats, us", log["float_us"], f"<= {LOG_TARGET_US:g}",
         log["float_us"] <= LOG_TARGET_US),
        ("nbddp.log call, 0-d tensors, us", log["tensor_us"], f"<= {LOG_TARGET_US:g}",
         log["tensor_us"] <= LOG_TARGET_US),
        (f"steps/s with log / without ({train['steps']} steps)", train["ratio"],
         train["target"], train["met"]),
        ("  the same, paired blocks in one run", train["paired_ratio"], train["target"],
         train["paired_ratio"] >= STEPS_TARGET),
        ("steps/s through progress / plain, paired", train["clock_ratio"],
         f">= {CLOCK_TARGET:.2f}", train["clock_ratio"] >= CLOCK_TARGET),
        ("  progress's cost per step / the MLP step", train["clock_share"],
         f"<= {1 - CLOCK_TARGET:.2f}", train["clock_share"] <= 1 - CLOCK_TARGET),
        ("print -> kernel, ranks idle, median ms", lat["idle"]["median_ms"],
         lat["idle"]["target"], lat["idle"]["met"]),
        ("print -> kernel, ranks training, median ms", lat["busy"]["median_ms"],
         lat["busy"]["target"], lat["busy"]["met"]),
    ]
    for name, value, target, met in rows:
        print(f"{name:44}{value:10.3f}  {target}  {verdict(met)}")
    print(f"  us per call, {log['calls']} calls each; wall (the table: the slower rank) and "
          "the rank process's CPU time:")
    for i, x in enumerate(log["per_rank"]):
        print(f"    rank {i}: nbddp.log floats {x['float_us']:.2f} wall {x['float_cpu_us']:.2f} "
              f"CPU, tensors {x['tensor_us']:.2f} wall {x['tensor_cpu_us']:.2f} CPU; an empty "
              f"function called the same way {x['no_op_us']:.2f} wall")
    print(f"  that run: {log['launch_wall_s']:.1f} s wall, {log['kernel_cpu_s']:.1f} s CPU in "
          "the kernel process")
    k = log["kernel_history"]
    print(f"  kernel history of that run: {k['rows']} rows for {k['logged_steps']} steps logged "
          f"by every rank ({k['distinct_steps']} distinct, {k['rows_over_every_rank']} averaged "
          "over every rank)")
    if k["rows"] != k["logged_steps"] or k["rows_over_every_rank"] != k["rows"]:
        print("    (the ranks' tight loops drift apart by seconds; a step one rank logs over "
              f"{STALE_SECONDS:g} s after another is averaged without it: see README)")
    w, wo = (" ".join(f"{x:.4g}" for x in train[k]) for k in ("with_log", "without_log"))
    print(f"  steps/s: with log median {train['with_log_median']:.1f} [{w}]  "
          f"without median {train['without_log_median']:.1f} [{wo}]")
    print(f"  an empty loop through nbddp.progress: {train['progress_loop_us']:.2f} us per "
          f"iteration (a plain range: {train['plain_loop_us']:.2f}); an MLP step: "
          f"{train['step_us']:.0f} us")
    for phase in ("idle", "busy"):
        s = lat[phase]
        print(f"  print -> kernel, {phase}: median {s['median_ms']:.1f} ms, "
              f"p90 {s['p90_ms']:.1f} ms, max {s['max_ms']:.1f} ms over {lat['prints']} prints "
              f"about {lat['interval_ms']} ms apart")


if __name__ == "__main__":
    main()
