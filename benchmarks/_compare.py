"""nbddp beside plain torchrun, without side effects on import (``bench_gpu.py`` needs
the GPUs that ``bench_launch.py`` hides): plain torchrun running ``_plain.py``, and the
two alternated round by round."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
Run = Callable[[], tuple[float, Any]]


def run_torchrun(tmp: Path, env: dict[str, str], fn: Callable[..., Any], *args: int,
                 nprocs: int = 2, timeout: float = 600.0) -> tuple[float, Any]:
    """Wall time and rank 0's value of ``torchrun --nproc_per_node NPROCS _plain.py`` for
    ``fn`` (a ``_workloads`` function)."""
    out = tmp / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nprocs), str(HERE / "_plain.py"), str(out), fn.__name__, *map(str, args)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except BaseException:
        proc.terminate()  # torchrun stops its ranks on SIGTERM
        proc.communicate()
        raise
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode}:\n{output.decode()[-4000:]}")
    value = json.loads(out.read_text())
    out.unlink()
    return elapsed, value


def alternate(repeats: int, nb: Run, tr: Run) -> tuple[list[tuple[float, Any]], ...]:
    """Run both ``repeats`` times, swapping which goes first each round."""
    nb_runs: list[tuple[float, Any]] = []
    tr_runs: list[tuple[float, Any]] = []
    for i in range(repeats):
        pair = [(nb, nb_runs), (tr, tr_runs)]
        for run, runs in pair if i % 2 == 0 else pair[::-1]:
            runs.append(run())
            print(".", end="", flush=True)
    print()
    return nb_runs, tr_runs
