"""Benchmark nbddp on a Ray cluster, beside Ray Train on the same work, through a kernel.

Starts a two-node Ray cluster on this machine (two ``ray start`` processes, ``--cpus``
CPUs each, no dashboard; stopped by PID at the end) and a real Jupyter kernel connected
to it, then measures, each figure timed by the Jupyter client from the execute request
to the kernel going idle (what a person waits for):

1. a launch of a trivial all-reduce on two nodes, call to result:
   ``nbddp.launch(fn, nprocs=1, cluster=nbddp.Ray(nodes=2))`` against Ray Train's
   ``TorchTrainer(fn, scaling_config=ScalingConfig(num_workers=2)).fit()``, alternated
   (target: nbddp at most 0.8x Ray Train);
2. a trivial ``%%ddp`` cell on a two-node Ray session, and a plain cell for reference
   (target: at most 20 ms median);
3. how long a metric logged on a rank takes to reach the kernel: rank 0 logs its clock
   every 0.25 s, and a thread in the kernel notes when each step shows up in the run's
   live history (target: at most 0.2 s median; Ray Train polls every 2 s);
4. tensors of 16 MiB, 256 MiB and 1 GiB as an argument of a session run on both nodes,
   through Ray's object store (the default) and over nbddp's channel
   (``NBDDP_SESSION_DATA=channel``), alternated: bytes from the kernel per second
   (target: at least 1 GB/s for 1 GiB), and a 1 GiB tensor as a result.

Needs ``pip install 'nbddp[ray]' 'ray[train]'`` (Ray Train for the peer). Writes its
record (``_record.py``) under ``benchmarks/results/``.
Run: ``python benchmarks/bench_ray.py [--repeats N] [--noisy] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo, even on a GPU machine
os.environ["NBDDP_STANDBY"] = "0"  # nothing starting in the background while timing
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

from _record import Record, add_options  # noqa: E402
from bench_session import run_cell, time_cells  # noqa: E402

LAUNCH_RATIO_TARGET = 0.8  # nbddp's launch at most this much of Ray Train's fit()
CELL_TARGET = 0.020  # seconds, median trivial cell on a Ray session
METRIC_TARGET = 0.2  # seconds, median metric latency
DATA_TARGET = 1e9  # bytes per second, a 1 GiB argument from the kernel
GIB = 1 << 30


class LocalRayCluster:
    """Ray nodes on this machine (two by default), started with ``ray start`` and stopped
    by PID."""

    def __init__(self, cpus: int, nodes: int = 2) -> None:
        self.cpus, self.nodes = cpus, nodes
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray-bench-", dir="/tmp"))
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.pids: set[int] = set()

    def __enter__(self) -> LocalRayCluster:
        ray = shutil.which("ray")
        assert ray, "the ray command is not on PATH: pip install 'nbddp[ray]'"
        for where in (["--head", f"--port={self.port}", "--include-dashboard=false"],
                      *[[f"--address={self.address}"]] * (self.nodes - 1)):
            subprocess.run([ray, "start", *where, f"--num-cpus={self.cpus}",
                            "--disable-usage-stats", f"--temp-dir={self.temp_dir}"],
                           check=True, capture_output=True, timeout=120)
        self.pids = _processes_under(self.temp_dir)
        return self

    def __exit__(self, *exc: object) -> None:
        pids = self.pids | _processes_under(self.temp_dir)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            time.sleep(2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _processes_under(temp_dir: Path) -> set[int]:
    """The PIDs of the processes that name the cluster's own temp dir on their command
    line (its GCS, raylets, agents and workers; nothing else names it)."""
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if str(temp_dir).encode() in cmdline.read_bytes():
                found.add(int(cmdline.parent.name))
    return found


SETUP = """
import os, time, threading, statistics
os.environ["RAY_ADDRESS"] = {address!r}
import ray
ray.init(address={address!r}, log_to_driver=False, logging_level="ERROR")
import nbddp, torch
%load_ext nbddp

def allreduce_fn(config=None):
    import torch, torch.distributed as dist
    value = torch.ones(1)
    dist.all_reduce(value)
    return float(value.item())

from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer
"""

NBDDP_LAUNCH = ("nbddp.launch(allreduce_fn, nprocs=1, cluster=nbddp.Ray(nodes=2), "
                "output='none')")
RAY_TRAIN_FIT = ("TorchTrainer(allreduce_fn, scaling_config=ScalingConfig(num_workers=2))"
                 ".fit()")

METRIC_CELL = """
def ticking(steps):
    import time, nbddp
    for step in range(steps):
        nbddp.log(step=step, sent=time.time())
        time.sleep(0.25)

_job = _session.submit(ticking, ({steps},), output="none")
_arrived = {{}}
while not _job.done():
    for row in _job.history:
        _arrived.setdefault(row["step"], time.time() - row["sent"])
    time.sleep(0.005)
_job.result()
print("LATENCIES", sorted(_arrived.values()))
"""


def launches(client: Any, repeats: int) -> dict[str, list[float]]:
    return time_cells(client, {"nbddp.launch, ray": NBDDP_LAUNCH,
                               "Ray Train fit()": RAY_TRAIN_FIT}, repeats, warm_up=1,
                      timeout=300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="launches each (default 10)")
    parser.add_argument("--cells", type=int, default=100, help="session cells (default 100)")
    parser.add_argument("--cpus", type=int, default=1, help="CPUs per Ray node (default 1)")
    add_options(parser)
    opts = parser.parse_args()
    from jupyter_client.manager import start_new_kernel

    record = Record.start("ray", opts)
    load = os.getloadavg()[0]
    result: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                              "ray_node_cpus": opts.cpus}
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as tmp, \
            LocalRayCluster(opts.cpus) as cluster:
        env = {**os.environ, "NBDDP_RUNS_DIR": str(Path(tmp) / "runs")}
        manager, client = start_new_kernel(kernel_name="python3", cwd=tmp, env=env)
        try:
            run_cell(client, SETUP.format(address=cluster.address), 120)
            print(f"launches: {opts.repeats} each, alternated", flush=True)
            result["launch_s"] = launches(client, opts.repeats)
            run_cell(client, "%ddp_session start --ray --nodes 2 --nprocs 1", 300)
            run_cell(client, "_session = get_ipython().magics_manager.registry"
                             "['DDPMagics'].session")
            print(f"session cells: {opts.cells} each", flush=True)
            result["cell_s"] = time_cells(client, {"plain cell": "1 + 1",
                                                   "%%ddp noop": "%%ddp\nNone"},
                                          opts.cells, warm_up=5)
            print("metric latency", flush=True)
            result["metric_latency_s"] = metric_latencies(client, steps=40)
            print("arguments by both routes, and a 1 GiB result", flush=True)
            result["data_s"] = data_routes(client)
            run_cell(client, "%ddp_session stop", 120)
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=False)
    result["loadavg_1min"] = {"start": load, "end": os.getloadavg()[0]}
    report(result, record.label)
    record.write(result)


ROUTES = {"object store": "object_store", "channel": "channel"}
SIZES_MIB = (16, 256, 1024)


def data_routes(client: Any) -> dict[str, list[float]]:
    """An argument of each size by each route (``NBDDP_SESSION_DATA``, read per run),
    alternated, and a 1 GiB result."""
    cells = {}
    for mib in SIZES_MIB:
        run_cell(client, f"_x{mib} = torch.ones({mib} * 2**18)  # {mib} MiB of float32")
        for name, route in ROUTES.items():
            cells[f"{mib} MiB argument, {name}"] = (
                f"os.environ['NBDDP_SESSION_DATA'] = {route!r}\n"
                f"_session.run(lambda t: t.numel(), _x{mib})")
    cells["1 GiB result"] = "_back = _session.run(lambda: torch.ones(2**28))"
    run_cell(client, "import os")
    timed = time_cells(client, cells, 3, warm_up=0, timeout=600)
    run_cell(client, "os.environ.pop('NBDDP_SESSION_DATA', None); del _back")
    return timed


def metric_latencies(client: Any, steps: int) -> list[float]:
    """Seconds from a rank's ``nbddp.log`` to the step showing in the kernel's history."""
    printed: list[str] = []

    def keep(msg: dict) -> None:
        if msg["msg_type"] == "stream":
            printed.append(msg["content"]["text"])

    reply = client.execute_interactive(METRIC_CELL.format(steps=steps), timeout=300,
                                       output_hook=keep)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"the metric cell failed: {reply['content']}")
    line = next(line for line in "".join(printed).splitlines() if line.startswith("LATENC"))
    return json.loads(line.split(" ", 1)[1])


def report(r: dict, label: str = "") -> None:
    med = {name: statistics.median(values) for group in ("launch_s", "cell_s", "data_s")
           for name, values in r.get(group, {}).items()}
    ratio = med["nbddp.launch, ray"] / med["Ray Train fit()"]
    metric = statistics.median(r["metric_latency_s"])
    print(f"\nnbddp on a two-node Ray cluster on this machine ({r['ray_node_cpus']} CPU per "
          f"node), {r['cpus']} CPUs, load {r['loadavg_1min']['start']:.2f} -> "
          f"{r['loadavg_1min']['end']:.2f}; medians{label}")
    for name, value in med.items():
        print(f"  {name:34}{value * 1000:10.1f} ms")
    print(f"launch, nbddp / Ray Train: {ratio:.3f} (target <= {LAUNCH_RATIO_TARGET}): "
          f"{'met' if ratio <= LAUNCH_RATIO_TARGET else 'MISSED'}")
    cell = med["%%ddp noop"]
    print(f"trivial session cell: {cell * 1000:.1f} ms (target <= {CELL_TARGET * 1000:.0f} "
          f"ms): {'met' if cell <= CELL_TARGET else 'MISSED'}")
    print(f"metric latency: {metric * 1000:.0f} ms (target <= {METRIC_TARGET * 1000:.0f} "
          f"ms): {'met' if metric <= METRIC_TARGET else 'MISSED'}")
    for mib in SIZES_MIB:
        rates = {name: mib * 2**20 / med[f"{mib} MiB argument, {name}"] / 1e9
                 for name in ROUTES}
        print(f"{mib} MiB argument, GB/s: " + ", ".join(
            f"{name} {rate:.2f}" for name, rate in rates.items()))
    rate = GIB / med["1024 MiB argument, object store"]
    print(f"1 GiB argument (the default route): {rate / 1e9:.2f} GB/s from the kernel "
          f"(target >= {DATA_TARGET / 1e9:.0f} GB/s): "
          f"{'met' if rate >= DATA_TARGET else 'MISSED'}")
    print(f"1 GiB result: {GIB / med['1 GiB result'] / 1e9:.2f} GB/s to the kernel")
    r["medians_s"] = med
    r["launch_ratio"] = ratio


if __name__ == "__main__":
    sys.exit(main())
