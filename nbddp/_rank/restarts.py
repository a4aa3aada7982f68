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
