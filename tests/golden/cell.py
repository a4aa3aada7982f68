#!/usr/bin/env python
"""cell.py: a cell exported from a notebook by nbddp.

Run it on one machine:   torchrun --nproc_per_node 2 cell.py
as a single process:     python cell.py
on a SLURM cluster:      sbatch cell.sbatch
"""

import os
import torch


SCALE = 3


def _distributed_env() -> bool:
    """torchrun sets RANK & co.; under srun (one task per rank) derive them from SLURM."""
    if "RANK" in os.environ:
        return True
    if "SLURM_PROCID" not in os.environ:
        return False
    import subprocess

    first = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()[0]
    os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                      LOCAL_RANK=os.environ["SLURM_LOCALID"], MASTER_ADDR=first)
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
    return True


def _start_process_group():
    """The default process group as nbddp sets it up: NCCL on a GPU rank, else gloo."""
    import torch
    import torch.distributed

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = torch.cuda.is_available() and local_rank < torch.cuda.device_count()
    if on_gpu:
        torch.cuda.set_device(local_rank)
    backend = "nccl" if on_gpu else "gloo"
    if _distributed_env():
        torch.distributed.init_process_group(backend)
    else:  # plain `python cell.py`: one rank, no rendezvous
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1)
    return torch.distributed


def _leave() -> None:
    """End the process once the run is over, as Python would (its other threads waited
    for, its exit handlers run: nbddp's last metrics), but without C++ static destructors:
    torch's gloo can abort in them after a clean run ("terminate called without an active
    exception"), and torchrun and SLURM would report the job as failed."""
    import atexit
    import sys
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_process_group = _start_process_group()

# --- the notebook cell ---------------------------------------------------------------
import torch.distributed as dist
x = torch.ones(1) * SCALE
dist.all_reduce(x)
# --- end of the cell -----------------------------------------------------------------

_process_group.destroy_process_group()
_leave()
