"""Benchmark submitting to SLURM from nbddp against a plain sbatch + torchrun job.

Both run the same all-reduce on ``--nodes`` nodes with 2 CPU ranks each: nbddp as
``nbddp.launch(fn, nprocs=2, cluster=Slurm(nodes=N))``, which returns rank 0's value; the
plain job as ``sbatch`` of ``srun torchrun ... _plain.py`` (c10d rendezvous), timed until
it has left the queue (polled every 0.1 s, quicker than ``sbatch --wait``) and its result
file is read. Needs a SLURM cluster (``bash scripts/slurm-up.sh``, then
``source /tmp/nbddp-slurm/env``) whose nodes share this filesystem.
Writes its record (``_record.py``) under ``benchmarks/results/``.
Run: ``python benchmarks/bench_slurm.py [--repeats N] [--nodes N] [--noisy] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import _workloads
from _record import Record, add_options
from bench_launch import HERE, alternate, summary

import nbddp
from nbddp._run.config import RunConfig
from nbddp._run.groups.shape import rank_environment

NPROCS = 2
WALL_TARGET = 1.10  # nbddp/plain wall time: at most
TIMEOUT = 600.0


def run_nbddp(nodes: int) -> tuple[float, Any]:
    start = time.perf_counter()
    value = nbddp.launch(_workloads.allreduce_once, nprocs=NPROCS, backend="gloo",
                         cluster=nbddp.Slurm(nodes=nodes), timeout=TIMEOUT)
    return time.perf_counter() - start, value


def plain_sbatch(tmp: Path, nodes: int) -> Path:
    script = tmp / "plain.sbatch"
    script.write_text(
        f"#!/bin/bash\n#SBATCH --nodes={nodes}\n#SBATCH --ntasks-per-node=1\n"
        f"#SBATCH --output={tmp}/plain-%j.out\n"
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        "port=$((20000 + SLURM_JOB_ID % 20000))\n"
        f'srun {sys.executable} -m torch.distributed.run --nnodes "$SLURM_NNODES" '
        f'--nproc_per_node {NPROCS} --rdzv-backend c10d --rdzv-id "$SLURM_JOB_ID" '
        f'--rdzv-endpoint "$head:$port" {HERE / "_plain.py"} {tmp}/result.json allreduce_once\n')
    return script


def _in_queue(job_id: str) -> bool:
    done = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i"], capture_output=True,
                          text=True)
    return done.returncode == 0 and bool(done.stdout.strip())


def run_plain(tmp: Path, env: dict[str, str], script: Path) -> tuple[float, Any]:
    out = tmp / "result.json"
    start = time.perf_counter()
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], env=env, check=True,
                            capture_output=True, text=True).stdout.strip().split(";")[0]
    deadline = time.monotonic() + TIMEOUT
    while _in_queue(job_id):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], check=False)
            raise RuntimeError(f"plain job {job_id} still queued after {TIMEOUT} s")
        time.sleep(0.1)
    elapsed = time.perf_counter() - start
    if not out.exists():
        raise RuntimeError(f"plain job {job_id} wrote no result: see {tmp}/plain-{job_id}.out")
    value = json.loads(out.read_text())
    out.unlink()
    return elapsed, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per launcher (default 5)")
    parser.add_argument("--nodes", type=int, default=2, help="nodes per job (default 2)")
    add_options(parser)
    opts = parser.parse_args()
    record = Record.start("slurm", opts)
    # Job files must be on the filesystem the nodes share: keep them beside this script.
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-slurm-", dir=HERE) as name:
        tmp = Path(name)
        os.environ["NBDDP_RUNS_DIR"] = str(tmp / "runs")
        env = rank_environment(RunConfig(nprocs=NPROCS))
        script = plain_sbatch(tmp, opts.nodes)
        print(f"submit + all_reduce on {opts.nodes} nodes: {opts.repeats} runs each ", end="",
              flush=True)
        nb, plain = alternate(opts.repeats, partial(run_nbddp, opts.nodes),
                              partial(run_plain, tmp, env, script))
    world = float(NPROCS * opts.nodes)
    if {v for _, v in nb + plain} != {world}:
        raise RuntimeError(f"all_reduce gave a wrong sum: {nb + plain}")
    wall = summary([t for t, _ in nb], [t for t, _ in plain], WALL_TARGET, False)
    print(f"\nnbddp vs plain sbatch + torchrun, {opts.nodes} nodes x {NPROCS} CPU ranks, "
          f"median of {opts.repeats}{record.label}: nbddp {wall['nbddp_median']:.2f} s, plain "
          f"{wall['torchrun_median']:.2f} s, ratio {wall['ratio']:.3f} (target "
          f"{wall['target']}: {'met' if wall['met'] else 'MISSED'})")
    print("  nbddp [" + " ".join(f"{t:.2f}" for t in wall["nbddp"]) + "]  plain ["
          + " ".join(f"{t:.2f}" for t in wall["torchrun"]) + "]")
    record.write({"nodes": opts.nodes, "nprocs_per_node": NPROCS,
                           "repeats": opts.repeats, "submit_wall_s": wall})


if __name__ == "__main__":
    main()
