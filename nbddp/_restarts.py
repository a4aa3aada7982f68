"""Which attempt a rank is on: torchrun's restarts of failed runs (``max_restarts``), and
SLURM's requeues of a job (each starts torchrun's count again)."""

from __future__ import annotations

import os


def restart_count() -> int:
    """How many times torchrun has restarted this run's ranks: 0 on the first attempt.

    A function that saves checkpoints can resume from its last one when this is more
    than 0. Works wherever torchrun starts the ranks (launches, exported scripts).
    """
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def requeue_count() -> int:
    """How many times SLURM has requeued this rank's job (``SLURM_RESTART_COUNT``): 0 on
    its first run, and outside SLURM."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


RESTART_SAFE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""For torchrun when it may restart the ranks. By default its workers share the
rendezvous store, where a restarted attempt reads the failed attempt's addresses and
cannot connect (pytorch/pytorch#135712); a store of their own per attempt avoids that,
for nbddp's process group and for one a user's code creates."""


def torchrun_environment(max_restarts: int) -> dict[str, str]:
    """What torchrun's environment needs for ``max_restarts``."""
    return dict(RESTART_SAFE_ENV) if max_restarts else {}
