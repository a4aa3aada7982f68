"""Benchmark nbddp on one GPU against plain torchrun running the same code (NCCL).

Measures, in one run, on ``--gpus 1``: (1) a cold launch whose rank all-reduces one CUDA
tensor, nbddp against ``torchrun --nproc_per_node 1``, alternated; (2) warm launches on
standby ranks (once they are ready), split into the hand-over (the call until the user's
function starts), the CUDA context, the NCCL communicator's set-up and the user's code,
and whether the idle standby group holds GPU memory (``nvidia-smi``'s compute
processes); (3) the steps/s of a small convolutional net in DDP, timed inside the rank,
against plain torchrun; (4) a session's cell round trip on the GPU; (5) a 1 GiB CUDA
tensor into a session's cell (it arrives on the rank's GPU) and out (it comes back on
the CPU).

Writes its record (``_record.py``) under ``benchmarks/results/`` after each part, so a
run stopped midway keeps the parts it finished.
Run: ``python benchmarks/bench_gpu.py [--repeats N] [--only PART] [--noisy] [--json PATH]``.
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
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))

import _workloads  # noqa: E402
import torch  # noqa: E402
from _compare import alternate, run_torchrun  # noqa: E402
from _record import Record, add_options  # noqa: E402

import nbddp  # noqa: E402
from nbddp._run.config import RunConfig  # noqa: E402
from nbddp._run.groups.shape import rank_environment  # noqa: E402

TIMEOUT = 300.0
GIB = 2**30


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    return time.perf_counter() - start, value


def ratio(nb: list[float], tr: list[float]) -> dict:
    a, b = statistics.median(nb), statistics.median(tr)
    return {"nbddp": nb, "torchrun": tr, "nbddp_median": a, "torchrun_median": b,
            "ratio": a / b}


def split_start(called_at: float) -> dict[str, float]:
    """On the rank (``init=False``): when the function started, and how long the CUDA
    context, the NCCL communicator (one all-reduce) and a small matmul each took."""
    import os
    import time

    import torch
    import torch.distributed as dist

    t0 = time.time()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    torch.zeros(1, device=device)
    torch.cuda.synchronize()
    t1 = time.time()
    dist.init_process_group("nccl", device_id=device)
    one = torch.ones(1, device=device)
    dist.all_reduce(one)
    torch.cuda.synchronize()
    t2 = time.time()
    x = torch.randn(1024, 1024, device=device)
    (x @ x).sum().item()
    t3 = time.time()
    dist.destroy_process_group()
    return {"handover": t0 - called_at, "cuda_context": t1 - t0, "nccl_init": t2 - t1,
            "user_code": t3 - t2}


def gpu_processes() -> set[int]:
    """PIDs of the processes that hold GPU memory (nvidia-smi's compute apps)."""
    text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout
    return {int(line) for line in text.split() if line.strip().isdigit()}


def ready_standby(timeout: float = 120.0) -> Any:
    """The standby group, once it is ready (its ranks have imported torch: a launch
    sooner would wait for them, and time that wait)."""
    deadline = time.monotonic() + timeout
    while (state := nbddp.standby()).status != "ready":
        if time.monotonic() > deadline:
            raise RuntimeError(f"standby ranks not ready after {timeout:g} s: {state}")
        time.sleep(0.1)
    return state


def warm_launches(repeats: int, pause: float) -> dict:
    nbddp.standby(True)
    try:
        nbddp.launch(split_start, gpus=1, init=False, args=(time.time(),))  # cold, starts one
        splits, walls, idle_on_gpu, warm = [], [], [], 0
        for _ in range(repeats):
            time.sleep(pause)
            state = ready_standby()
            idle_on_gpu.append(sorted(gpu_processes() & set(state.pids)))
            start = time.perf_counter()
            job = nbddp.launch(split_start, gpus=1, init=False, args=(time.time(),),
                               wait=False)
            splits.append(job.result())
            walls.append(time.perf_counter() - start)
            warm += job.warm
            print(".", end="", flush=True)
        print()
    finally:
        nbddp.standby(False)
    parts = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
    return {"wall": walls, "wall_median": statistics.median(walls), "warm": warm,
            "parts": splits, "parts_median": parts, "idle_standby_pids_on_gpu": idle_on_gpu}


def noop() -> None:
    return None


def session_figures(cells: int, repeats: int) -> dict:
    def takes(x: Any) -> str:
        return str(x.device)

    def gives(n: int) -> Any:
        import torch

        return torch.ones(n, dtype=torch.uint8, device="cuda")

    with nbddp.Session(gpus=1) as s:
        s.run(noop)
        trip = [timed(s.run, noop)[0] for _ in range(cells)]
        x = torch.ones(GIB, dtype=torch.uint8, device="cuda")
        base = statistics.median(trip)
        into, out, landed = [], [], set()
        for _ in range(repeats):
            seconds, where = timed(s.run, takes, x)
            into.append(seconds)
            landed.add(where)
            seconds, back = timed(s.run, gives, GIB)
            out.append(seconds)
            assert back.device.type == "cpu" and back.numel() == GIB
            del back
    return {"cell_round_trip_s": trip, "cuda_1gib_in_samples_s": into,
            "cuda_1gib_out_samples_s": out, "cell_round_trip_ms": base * 1000,
            "cuda_1gib_in_s": statistics.median(into), "arrived_on": sorted(landed),
            "cuda_1gib_in_gb_per_s": GIB / 1e9 / max(statistics.median(into) - base, 1e-9),
            "cuda_1gib_out_s": statistics.median(out),
            "cuda_1gib_out_gb_per_s": GIB / 1e9 / max(statistics.median(out) - base, 1e-9)}


PARTS = ("cold", "warm", "training", "session")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (default 3)")
    parser.add_argument("--steps", type=int, default=300, help="timed training steps")
    parser.add_argument("--cells", type=int, default=50, help="session round trips")
    add_options(parser)
    parser.add_argument("--only", choices=PARTS, action="append",
                        help="run only this part (may be repeated; default: all)")
    opts = parser.parse_args()
    parts = set(opts.only or PARTS)
    record = Record.start("gpu", opts)
    nbddp.standby(False)
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "cpus": os.cpu_count(), "repeats": opts.repeats}
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as tmp:
        os.environ["TMPDIR"] = tempfile.tempdir = tmp
        os.environ["NBDDP_RUNS_DIR"] = str(Path(tmp) / "runs")
        env = rank_environment(RunConfig(nprocs=1)) | {"BENCH_BACKEND": "nccl"}
        plain = partial(run_torchrun, Path(tmp), env, nprocs=1, timeout=TIMEOUT)
        plain(_workloads.allreduce_once_cuda)  # file cache and the driver, not counted
        if "cold" in parts:
            print("cold launch + CUDA all_reduce ", end="", flush=True)
            nb, tr = alternate(
                opts.repeats, partial(timed, nbddp.launch, _workloads.allreduce_once_cuda, gpus=1),
                partial(plain, _workloads.allreduce_once_cuda))
            result["cold_launch_s"] = ratio([s for s, _ in nb], [s for s, _ in tr])
            report(result, record)
        if "warm" in parts:
            print("warm launches, split ", end="", flush=True)
            result["warm_launch"] = warm_launches(opts.repeats + 2, 2.0)
            report(result, record)
        if "training" in parts:
            print("conv DDP training ", end="", flush=True)
            args = (opts.steps, 30)
            nb, tr = alternate(
                opts.repeats,
                partial(timed, nbddp.launch, _workloads.train_conv, gpus=1, args=args),
                partial(plain, _workloads.train_conv, *args))
            result["conv_steps_per_s"] = ratio([v["steps_per_s"] for _, v in nb],
                                               [v["steps_per_s"] for _, v in tr])
            result["conv_threads"] = {"nbddp": nb[0][1]["threads"], "torchrun": tr[0][1]["threads"]}
            report(result, record)
        if "session" in parts:
            print("session on the GPU", flush=True)
            result["session"] = session_figures(opts.cells, opts.repeats)
            report(result, record)


def report(result: dict, record: Record) -> None:
    """The figures so far, printed and saved (a run stopped midway keeps what it has)."""
    print(json.dumps(result, indent=1) + record.label, flush=True)
    record.write(result)


if __name__ == "__main__":
    main()
