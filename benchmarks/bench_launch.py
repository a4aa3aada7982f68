"""Benchmark nbddp.launch against plain torchrun running the same code, on 2 CPU ranks.

Measures (1) the wall time of a cold launch (standby off) whose ranks all-reduce one
tensor, against plain torchrun, alternated; (2) the same launch warm, on standby ranks,
after a pause such as a person takes between cells, and the idle memory of a standby
group; (3) the steady-state steps/s of a small DDP training loop, timed inside the
ranks, against plain torchrun, alternated. Medians and ratios are printed; the record
(``_record.py``, under ``benchmarks/results/``) keeps every sample.
Run: ``python benchmarks/bench_launch.py [--repeats N] [--noisy] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Both launchers' ranks import _workloads by name: put this folder on PYTHONPATH before
# anything starts, so every rank (nbddp's and plain torchrun's) finds it the same way.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo for both, even on a GPU machine

import _workloads  # noqa: E402
import torch  # noqa: E402
from _compare import alternate, run_torchrun  # noqa: E402
from _record import Record, add_options  # noqa: E402

import nbddp  # noqa: E402
from nbddp._run.config import RunConfig  # noqa: E402
from nbddp._run.groups.shape import rank_environment  # noqa: E402

NPROCS = 2
TIMEOUT = 600.0
LAUNCH_TARGET = 1.05  # nbddp/torchrun wall time of a cold launch: at most
WARM_TARGET = 0.10  # seconds, median of a warm launch: at most
STEPS_TARGET = 0.98  # nbddp/torchrun steps/s: at least


def run_nbddp(fn: Callable[..., Any], *args: int) -> tuple[float, Any]:
    """Wall time and rank 0's value of ``nbddp.launch(fn, nprocs=2, args=args)``."""
    start = time.perf_counter()
    value = nbddp.launch(fn, nprocs=NPROCS, args=args, backend="gloo", timeout=TIMEOUT)
    return time.perf_counter() - start, value


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in KiB: PSS shares the pages of torch's libraries fairly."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    pss = int(next(line for line in rollup.splitlines() if line.startswith("Pss:")).split()[1])
    return rss, pss


def warm_launches(repeats: int, pause: float) -> dict:
    """Launches on standby ranks, each after ``pause`` seconds (a person between cells);
    the idle memory of the waiting group is read during the pauses."""
    nbddp.standby(True)
    try:
        run_nbddp(_workloads.allreduce_once)  # cold: it starts the first standby group
        times, ready, memory = [], 0, []
        for _ in range(repeats):
            time.sleep(pause)
            state = nbddp.standby()
            ready += state.status == "ready"
            if state.status == "ready":
                memory.append([memory_kib(pid) for pid in state.pids])
            start = time.perf_counter()
            job = nbddp.launch(_workloads.allreduce_once, nprocs=NPROCS, backend="gloo",
                               wait=False, timeout=TIMEOUT)
            value = job.result()
            times.append(time.perf_counter() - start)
            if value != float(NPROCS) or not job.warm:
                raise RuntimeError(f"warm launch: value {value}, warm {job.warm}")
            print(".", end="", flush=True)
        print()
    finally:
        nbddp.standby(False)
    median = statistics.median(times)
    idle = _idle_memory(memory)
    return {"seconds": times, "median": median, "target": f"<= {WARM_TARGET:.2f} s",
            "met": median <= WARM_TARGET, "pause_s": pause, "found_ready": ready,
            "idle_memory_mib": idle}


def _idle_memory(readings: list[list[tuple[int, int]]]) -> dict:
    """Medians over the readings: torchrun, each rank, and the whole group (MiB)."""
    if not readings:
        return {}
    def med(values: list[int]) -> float:
        return round(statistics.median(values) / 1024, 1)
    processes = len(readings[0])
    return {
        "torchrun_rss": med([r[0][0] for r in readings]),
        "rank_rss": med([r[i][0] for r in readings for i in range(1, processes)]),
        "group_rss": med([sum(rss for rss, _ in r) for r in readings]),
        "group_pss": med([sum(pss for _, pss in r) for r in readings]),
    }


def summary(nb: list[float], tr: list[float], target: float, higher_is_better: bool) -> dict:
    """Medians, ratio nbddp/torchrun and whether it meets its target."""
    nb_med, tr_med = statistics.median(nb), statistics.median(tr)
    ratio = nb_med / tr_med
    met = ratio >= target if higher_is_better else ratio <= target
    return {"nbddp": nb, "torchrun": tr, "nbddp_median": nb_med, "torchrun_median": tr_med,
            "ratio": ratio, "target": f"{'>=' if higher_is_better else '<='} {target:.2f}",
            "met": met}


def main() -> None:
    """Parse options, run both benchmarks, print the table, write JSON if asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per launcher (default 5)")
    parser.add_argument("--steps", type=int, default=1000, help="timed training steps")
    parser.add_argument("--warmup", type=int, default=50, help="untimed training steps first")
    parser.add_argument("--pause", type=float, default=5.0,
                        help="seconds between warm launches (default 5)")
    add_options(parser)
    opts = parser.parse_args()
    if min(opts.repeats, opts.steps) < 1 or opts.warmup < 0:
        parser.error("--repeats and --steps must be at least 1, --warmup at least 0")
    record = Record.start("launch", opts)
    load_start = os.getloadavg()[0]
    nbddp.standby(False)  # cold launches and training: no standby group starting beside
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as tmp:
        # torchrun leaves a torchelastic_* log dir in TMPDIR per run: keep them in ours.
        os.environ["TMPDIR"] = tempfile.tempdir = tmp
        os.environ["NBDDP_RUNS_DIR"] = str(Path(tmp) / "runs")  # keep the user's records
        env = rank_environment(RunConfig(nprocs=NPROCS))  # what nbddp gives its torchrun
        print(f"launch + all_reduce: {opts.repeats} runs each ", end="", flush=True)
        trivial_nb = partial(run_nbddp, _workloads.allreduce_once)
        trivial_tr = partial(run_torchrun, Path(tmp), env, _workloads.allreduce_once)
        trivial_tr()  # warm the file cache (python, torch) for both; not counted
        nb, tr = alternate(opts.repeats, trivial_nb, trivial_tr)
        if {v for _, v in nb + tr} != {float(NPROCS)}:
            raise RuntimeError(f"all_reduce gave a wrong sum: {nb + tr}")
        launch = summary([t for t, _ in nb], [t for t, _ in tr], LAUNCH_TARGET, False)
        print(f"warm launch + all_reduce, {opts.pause:g} s apart: {opts.repeats} runs ",
              end="", flush=True)
        warm = warm_launches(opts.repeats, opts.pause)
        print(f"DDP MLP training: {opts.repeats} runs each ", end="", flush=True)
        args = (opts.steps, opts.warmup)
        nb, tr = alternate(opts.repeats, partial(run_nbddp, _workloads.train_mlp, *args),
                           partial(run_torchrun, Path(tmp), env, _workloads.train_mlp, *args))
    train = summary([v["steps_per_s"] for _, v in nb], [v["steps_per_s"] for _, v in tr],
                    STEPS_TARGET, True)
    threads = {"nbddp": nb[0][1]["threads"], "torchrun": tr[0][1]["threads"]}
    result = {
        "nprocs": NPROCS, "repeats": opts.repeats, "steps": opts.steps, "warmup": opts.warmup,
        "torch": torch.__version__, "python": platform.python_version(),
        "cpus": os.cpu_count(), "threads_per_rank": threads,
        "loadavg_1min": {"start": load_start, "end": os.getloadavg()[0]},
        "launch_wall_s": launch, "warm_launch_s": warm, "train_steps_per_s": train,
    }
    print_table(result, record.label)
    record.write(result)


def print_table(r: dict, label: str = "") -> None:
    """Print the medians, ratios and targets as a small table."""
    print(f"\nnbddp vs plain torchrun: {r['nprocs']} CPU ranks (gloo), median of {r['repeats']} "
          f"runs each; torch {r['torch']}, {r['cpus']} CPUs, {r['threads_per_rank']['nbddp']:.0f}/"
          f"{r['threads_per_rank']['torchrun']:.0f} threads per rank (nbddp/torchrun), "
          f"load {r['loadavg_1min']['start']:.2f} -> {r['loadavg_1min']['end']:.2f}{label}")
    print(f"{'':34}{'nbddp':>10}{'torchrun':>10}{'ratio':>8}  target")
    rows = [("launch + all_reduce, wall s", r["launch_wall_s"], "{:10.3f}"),
            (f"MLP DDP training, steps/s ({r['steps']})", r["train_steps_per_s"], "{:10.1f}")]
    for name, s, fmt in rows:
        verdict = "met" if s["met"] else "MISSED"
        print(f"{name:34}{fmt.format(s['nbddp_median'])}{fmt.format(s['torchrun_median'])}"
              f"{s['ratio']:8.3f}  {s['target']}  {verdict}")
    warm = r["warm_launch_s"]
    print(f"{'warm launch + all_reduce, wall s':34}{warm['median']:10.3f}{'':18}  "
          f"{warm['target']}  {'met' if warm['met'] else 'MISSED'}")
    for name, s, _ in rows:
        nb, tr = (" ".join(f"{x:.4g}" for x in s[k]) for k in ("nbddp", "torchrun"))
        print(f"  {name}: nbddp [{nb}]  torchrun [{tr}]")
    print(f"  warm launch, {warm['pause_s']:g} s apart (standby ready before "
          f"{warm['found_ready']} of {len(warm['seconds'])}): "
          + " ".join(f"{x:.3f}" for x in warm["seconds"]))
    memory = warm["idle_memory_mib"]
    if memory:
        print(f"  idle standby group: RSS {memory['group_rss']:.0f} MiB (torchrun "
              f"{memory['torchrun_rss']:.0f}, each rank {memory['rank_rss']:.0f}), "
              f"PSS {memory['group_pss']:.0f} MiB")


if __name__ == "__main__":
    main()
