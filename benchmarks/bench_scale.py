"""Benchmark how the kernel's own work grows with the number of ranks (issue: many ranks).

For sessions of N CPU ranks (gloo) on this machine, and, with ``--ray ADDRESS``, split
over the Ray cluster's nodes, it measures twice: in a real Jupyter kernel, as a user
meets it (``%ddp_session start``, then ``%%ddp`` cells, the kernel's CPU read from
/proc, its live panel included), and in this process through ``nbddp.Session`` (the
kernel's side of nbddp alone, text display, output off):

1. **a no-op cell**: the driving process's CPU time (every thread: the channel, the
   pump, the panel) and the wall time per ``Session.run`` of a function that does
   nothing, the median of ``--cells`` calls after a warm-up;
2. **metrics while training**: every rank logs a metric ``--rate`` times a second for
   ``--seconds``; the driving process's CPU time per second of that (one core = 100%).

The targets the issue set are
printed beside the figures (kernel CPU per no-op cell at 32 ranks at most 2x that at 4
ranks on as many nodes; 32 ranks' metrics at 100 steps/s at most 5% of a core).

With ``--monarch PYTHON`` (an interpreter whose environment has ``torchmonarch``), the
same rank counts run on Monarch too, in the same run (``peer_monarch.py``), printed beside
nbddp's session in this process: no-op and all-reduce call, and start.

Writes its record (``_record.py``, every cell's figures) under ``benchmarks/results/``.
Run: ``python benchmarks/bench_scale.py [--ranks 2 4 8 16 32] [--monarch PYTHON]
[--noisy] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo, even on a GPU machine
os.environ["NBDDP_STANDBY"] = "0"  # nothing starting in the background while timing

from _record import Record, add_options  # noqa: E402
from bench_session import run_cell  # noqa: E402

import nbddp  # noqa: E402

CELL_TARGET_RATIO = 2.0
METRICS_TARGET = 0.05  # of one core


def noop() -> None:
    """The no-op cell."""


def log_for(seconds: float, rate: float) -> int:
    """Log one metric ``rate`` times a second for ``seconds``; the steps logged."""
    import time

    import nbddp

    step, start = 0, time.monotonic()
    while (now := time.monotonic()) - start < seconds:
        nbddp.log(step=step, loss=1.0 / (step + 1))
        step += 1
        time.sleep(max(0.0, start + step / rate - now))
    return step


def all_reduce() -> float:
    """The all-reduce cell: one small tensor summed over every rank."""
    import torch
    import torch.distributed as dist

    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    return float(tensor.item())


def cpu_and_wall(fn: Any) -> tuple[float, float]:
    """This process's CPU seconds (every thread) and the wall seconds ``fn()`` took."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def measure(session: nbddp.Session, cells: int, seconds: float, rate: float
            ) -> dict[str, float]:
    for _ in range(5):
        session.run(noop)  # warm-up
    per_cell = [cpu_and_wall(lambda: session.run(noop)) for _ in range(cells)]
    for _ in range(5):
        session.run(all_reduce)  # warm-up
    reduces = [cpu_and_wall(lambda: session.run(all_reduce))[1] for _ in range(cells)]
    cpu, wall = cpu_and_wall(lambda: session.run(log_for, seconds, rate))
    return {"cell_cpu_s": [c for c, _ in per_cell], "cell_wall_s": [w for _, w in per_cell],
            "all_reduce_wall_s": reduces, "metrics_cpu_s": cpu, "metrics_wall_s": wall,
            "cell_cpu_ms": 1000 * statistics.median(c for c, _ in per_cell),
            "cell_wall_ms": 1000 * statistics.median(w for _, w in per_cell),
            "all_reduce_wall_ms": 1000 * statistics.median(reduces),
            "metrics_cpu_share": cpu / wall}


def one_shape(ranks: int, nodes: int, address: str | None, opts: argparse.Namespace
              ) -> dict[str, float]:
    """The figures of one shape, in this process (``nbddp.Session``, text display)."""
    started = time.perf_counter()
    os.environ["NBDDP_DISPLAY"] = "text"
    if address is None:
        session = nbddp.Session(nprocs=ranks, output="none")
    else:
        os.environ["RAY_ADDRESS"] = address
        session = nbddp.Session(nprocs=ranks // nodes, output="none",
                                cluster=nbddp.Ray(nodes=nodes))
    try:
        figures = {"start_s": time.perf_counter() - started}
        figures |= measure(session, opts.cells, opts.seconds, opts.rate)
    finally:
        session.close()
        del os.environ["NBDDP_DISPLAY"]
    return figures


def kernel_cpu(pid: int) -> float:
    """The CPU seconds process ``pid`` has used (every thread), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def in_a_kernel(ranks: int, nodes: int, address: str | None, opts: argparse.Namespace
                ) -> dict[str, float]:
    """The figures of one shape through a real kernel: ``%%ddp`` cells on a session."""
    from jupyter_client.manager import start_new_kernel

    start = f"%ddp_session start --nprocs {ranks // nodes}"
    env = dict(os.environ)
    if address is not None:
        start += f" --ray --nodes {nodes}"
        env["RAY_ADDRESS"] = address
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as cwd:
        manager, client = start_new_kernel(kernel_name="python3", cwd=cwd, env=env)
        pid = manager.provisioner.process.pid
        try:
            run_cell(client, "%load_ext nbddp", 120)
            began = time.perf_counter()
            run_cell(client, start, 600)
            figures = {"start_s": time.perf_counter() - began}
            for _ in range(5):
                run_cell(client, "%%ddp\nNone")  # warm-up
            cpu, wall = [], []
            for _ in range(opts.cells):
                c, w = kernel_cpu(pid), time.perf_counter()
                run_cell(client, "%%ddp\nNone")
                cpu.append(kernel_cpu(pid) - c)
                wall.append(time.perf_counter() - w)
            figures["cell_cpu_s"], figures["cell_wall_s"] = cpu, wall
            figures["cell_cpu_ms"] = 1000 * statistics.mean(cpu)  # (ticks: mean, not median)
            figures["cell_wall_ms"] = 1000 * statistics.median(wall)
            run_cell(client, "from bench_scale import log_for")
            c, w = kernel_cpu(pid), time.perf_counter()
            run_cell(client, f"%%ddp\nlog_for({opts.seconds}, {opts.rate})", 600)
            figures["metrics_cpu_share"] = (kernel_cpu(pid) - c) / (time.perf_counter() - w)
            run_cell(client, "%ddp_session stop", 120)
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=False)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--cells", type=int, default=100, help="no-op cells per shape")
    parser.add_argument("--seconds", type=float, default=5.0, help="of metrics per shape")
    parser.add_argument("--rate", type=float, default=100.0, help="metric steps/s per rank")
    parser.add_argument("--ray", metavar="ADDRESS",
                        help="also on this Ray cluster's nodes ('local': --nodes Ray "
                             "nodes started on this machine for the run)")
    parser.add_argument("--nodes", type=int, default=2, help="Ray nodes (with --ray)")
    parser.add_argument("--without-relay", action="store_true",
                        help="nbddp alone only, every rank on its own connection (no "
                             "node relay): the same sessions without the feature")
    parser.add_argument("--ray-only", action="store_true",
                        help="with --ray: the Ray shapes alone (not one node's)")
    parser.add_argument("--monarch", metavar="PYTHON",
                        help="also Monarch on this host, in the same run: an interpreter "
                             "whose environment has torchmonarch (peer_monarch.py)")
    add_options(parser)
    opts = parser.parse_args()
    record = Record.start("scale", opts)
    if opts.ray == "local":
        from bench_ray import LocalRayCluster

        with LocalRayCluster(cpus=1, nodes=opts.nodes) as cluster:
            opts.ray = cluster.address
            run(opts, record)
    else:
        run(opts, record)


def run(opts: argparse.Namespace, record: Record) -> None:
    shapes = [] if opts.ray and opts.ray_only else [(n, 1, None) for n in opts.ranks]
    if opts.ray:
        shapes += [(n, opts.nodes, opts.ray) for n in opts.ranks if n % opts.nodes == 0]
    results: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as tmp:
        os.environ["NBDDP_RUNS_DIR"] = str(Path(tmp) / "runs")  # keep the user's records
        print(f"{'ranks':>5} {'nodes':>5} {'start s':>8} {'cell CPU ms':>12} "
              f"{'cell wall ms':>13} {'metrics CPU':>12}")
        os.environ["PYTHONPATH"] = os.pathsep.join(  # (the kernel imports log_for here)
            filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
        ways = [("kernel", in_a_kernel), ("python", one_shape)]
        if opts.without_relay:  # (in this process only: the kernel's would not see it)
            import nbddp._local.cores
            import nbddp._run.config

            nbddp._local.cores.RELAY_FROM = nbddp._run.config.RELAY_FROM_PER_NODE = 10**9
            ways = ways[1:]
        for where, measure_one in ways:
            print(f"{where}:")
            results[where] = {}
            for ranks, nodes, address in shapes:
                figures = measure_one(ranks, nodes, address, opts)
                results[where][f"{ranks}x{nodes}"] = figures
                print(f"{ranks:>5} {nodes:>5} {figures['start_s']:>8.1f} "
                      f"{figures['cell_cpu_ms']:>12.2f} {figures['cell_wall_ms']:>13.2f} "
                      f"{100 * figures['metrics_cpu_share']:>11.1f}%", flush=True)
    if opts.monarch:
        results["monarch"] = beside_monarch(opts, results["python"])
    for where in [w for w in ("kernel", "python") if w in results]:
        print(f"targets, {where}{record.label}:")
        report_targets(results[where], opts.rate)
    record.write(results)


def beside_monarch(opts: argparse.Namespace, nbddp_figures: dict[str, dict[str, float]]
                   ) -> dict[str, dict[str, float]]:
    """Monarch on this host at the same rank counts, run after nbddp's shapes in this
    run; printed beside nbddp's (``Session.run`` from this process, as Monarch's calls
    are): no-op and all-reduce call, ms; start, s."""
    found = subprocess.run([opts.monarch, str(Path(__file__).with_name("peer_monarch.py")),
                            str(opts.cells), *map(str, opts.ranks)],
                           capture_output=True, text=True, check=True, timeout=1800)
    monarch = {f"{f['ranks']}x1": f for f in map(json.loads, found.stdout.splitlines())}
    print("beside Monarch, one host (no-op / all-reduce call ms; start s):")
    print(f"{'ranks':>5} {'nbddp':>22} {'Monarch':>22} {'nbddp/Monarch wall':>19}")
    for key, peer in monarch.items():
        ours = nbddp_figures[key]
        print(f"{peer['ranks']:>5} {ours['cell_wall_ms']:>7.2f} / "
              f"{ours['all_reduce_wall_ms']:>5.2f}; {ours['start_s']:>4.1f} "
              f"{peer['cell_wall_ms']:>7.2f} / "
              f"{peer['all_reduce_wall_ms']:>5.2f}; {peer['start_s']:>4.1f} "
              f"{ours['cell_wall_ms'] / peer['cell_wall_ms']:>8.2f}x / "
              f"{ours['all_reduce_wall_ms'] / peer['all_reduce_wall_ms']:.2f}x", flush=True)
    return monarch


def report_targets(shapes: dict[str, dict[str, float]], rate: float) -> None:
    """The issue's targets, where this run measured what they compare."""
    for nodes in sorted({int(key.split("x")[1]) for key in shapes}):
        small, large = shapes.get(f"4x{nodes}"), shapes.get(f"32x{nodes}")
        if small and large:
            ratio = large["cell_cpu_ms"] / small["cell_cpu_ms"]
            verdict = "met" if ratio <= CELL_TARGET_RATIO else "not met"
            print(f"kernel CPU per no-op cell, 32 ranks / 4 ranks on {nodes} node(s): "
                  f"{ratio:.2f}x (target <= {CELL_TARGET_RATIO:g}x: {verdict})")
        if large:
            share = large["metrics_cpu_share"]
            verdict = "met" if share <= METRICS_TARGET else "not met"
            print(f"kernel CPU while 32 ranks log {rate:g} steps/s on {nodes} node(s): "
                  f"{100 * share:.1f}% of a core (target <= {100 * METRICS_TARGET:g}%: "
                  f"{verdict})")


if __name__ == "__main__":
    main()
