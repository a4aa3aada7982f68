#!/usr/bin/env python
"""train.py: `train` exported from a notebook by nbddp.

Run it on one machine:   torchrun --nproc_per_node 2 train.py
as a single process:     python train.py
on a SLURM cluster:      sbatch train.sbatch
"""

import os
import cloudpickle
import math
import torch


# Objects that have no source in the notebook, saved beside this script.
_here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(_here, 'train.payload.pkl'), "rb") as _file:
    _data = cloudpickle.load(_file)
weights = _data['weights']
_arg1 = _data['_arg1']


SCALE = 3


def helper(x):
    return x * SCALE


def train(steps):
    return helper(steps)


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
    else:  # plain `python train.py`: one rank, no rendezvous
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


def main() -> None:
    """Call train on every rank; print rank 0's result."""
    dist = _start_process_group()
    result = train(3, _arg1)
    if dist.get_rank() == 0:
        print(f"train returned: {result!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    _leave()
