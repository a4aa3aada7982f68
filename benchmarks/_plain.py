"""Plain-torchrun entry: ``torchrun ... _plain.py OUT_JSON WORKLOAD [INT_ARGS...]``.

Does what an nbddp rank does around the user's function: init the process group (gloo,
or NCCL on the rank's GPU where ``BENCH_BACKEND=nccl``),
call it, destroy the group, and leave with ``os._exit`` (gloo can abort in C++ static
destructors at a normal exit, failing the run). Rank 0 writes the value to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import _workloads
import torch.distributed as dist


def main(argv: list[str]) -> None:
    """Run one workload from ``_workloads`` on this rank."""
    out, name, *args = argv
    backend = os.environ.get("BENCH_BACKEND", "gloo")  # nccl: bench_gpu.py's GPU ranks
    if backend == "nccl":
        import torch

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # as an nbddp GPU rank does
    dist.init_process_group(backend)
    value = getattr(_workloads, name)(*map(int, args))
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(value))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
