"""A SLURM job's ranks before the job's end: a stop is coming, run me again later.

With ``Slurm(signal_before=S)``, SLURM signals the batch script S seconds before the
time limit; the script writes a line into the run folder's stop file, and each rank's
watcher sees it: ``stop_requested()`` turns true. Nothing signals the ranks themselves,
so their own children (data loader workers, compile workers) and a framework's own
SIGUSR1 handler are left alone. A rank that has saved its state calls ``requeue()``:
its attempt ends, and once every rank has ended the batch script requeues the job,
which then runs the function again from its start. The rank side of these lives here;
the batch script's side is in ``_slurm.sbatch``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from .._wire.rundir import REQUEUE_FILE_ENV, STOP_FILE_ENV

_POLL_INTERVAL = 1.0  # a stat-free open and read each second: NFS shows new data on open

_stop = threading.Event()


class RequeueRequested(BaseException):
    """Raised by ``requeue()``; a BaseException, so ``except Exception`` lets it pass."""


def stop_requested() -> bool:
    """True once SLURM has said the job's time limit is near (``Slurm(signal_before=S)``).

    Check it between steps: save a checkpoint, then call ``nbddp.requeue()`` so that
    the job runs again and resumes from it. Always False outside such a job.
    """
    return _stop.is_set()


def requeue() -> NoReturn:
    """End this rank's attempt so that SLURM runs the job again (call it on every rank).

    Once every rank has ended, the job goes back to the queue; when it runs again, the
    function starts from its beginning (resume from your checkpoint) and the notebook
    follows the new run to its result. Only in a job submitted to SLURM
    (``launch(cluster=nbddp.Slurm())``).
    """
    if not os.environ.get(REQUEUE_FILE_ENV):
        raise RuntimeError("nbddp.requeue() puts a SLURM job back in the queue: it works "
                           "in a run submitted to SLURM: launch(cluster=nbddp.Slurm()) or "
                           "%%ddp --slurm")
    raise RequeueRequested


def mark_requeue() -> None:
    """Tell the batch script that this attempt asked to be run again."""
    Path(os.environ[REQUEUE_FILE_ENV]).touch()


def watch_for_stop(on_stop: Callable[[], None]) -> None:
    """In a job with a stop file, set ``stop_requested()`` (and call ``on_stop``) once
    the batch script writes into it."""
    path = os.environ.get(STOP_FILE_ENV)
    if path:
        threading.Thread(target=_watch, args=(Path(path), on_stop), daemon=True,
                         name="nbddp-stop-watch").start()


def _watch(path: Path, on_stop: Callable[[], None]) -> None:
    while not _written(path):
        _stop.wait(_POLL_INTERVAL)
    _stop.set()
    on_stop()


def _written(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return bool(f.read(1))
    except FileNotFoundError:
        return False
