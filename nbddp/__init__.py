"""nbddp: run PyTorch DistributedDataParallel from a Jupyter notebook.

The names below are the public API. Those that only the notebook side needs load on
first use, so a rank (which imports ``nbddp`` for ``log`` and ``progress``) never loads
the kernel's machinery.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import TYPE_CHECKING, Any

from ._errors import NbddpError, PayloadError, WorkerError
from ._rank.metrics import log, progress
from ._rank.requeue import requeue, stop_requested
from ._rank.restarts import restart_count
from ._version import __version__ as __version__

if TYPE_CHECKING:
    from ._backends import Ray, Slurm, StandbyState, standby
    from ._export.script import export
    from ._launch import attach, last_job, launch
    from ._run.job import Job
    from ._session import Session, SessionStatus

__all__ = [
    "Job",
    "NbddpError",
    "PayloadError",
    "Ray",
    "Session",
    "SessionStatus",
    "Slurm",
    "StandbyState",
    "WorkerError",
    "attach",
    "export",
    "last_job",
    "launch",
    "log",
    "progress",
    "requeue",
    "restart_count",
    "standby",
    "stop_requested",
]

_ON_FIRST_USE = {
    "Job": "._run.job", "Session": "._session", "SessionStatus": "._session",
    "Ray": "._backends", "Slurm": "._backends", "StandbyState": "._backends",
    "attach": "._launch", "export": "._export.script", "last_job": "._launch",
    "launch": "._launch", "standby": "._backends",
}


def __getattr__(name: str) -> Any:
    module = _ON_FIRST_USE.get(name)
    if module is None:
        raise AttributeError(f"module 'nbddp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _warm_up_in_a_notebook() -> None:
    """In a notebook's kernel, standby ranks of the default shape start in the background
    as nbddp is imported, so that the first ``launch``, ``%%ddp`` cell or session a person
    runs a few seconds later starts warm (``NBDDP_STANDBY=0`` or ``standby(False)``, as
    for any standby ranks, turns it off)."""
    from ._notebook.kernel import in_notebook_kernel

    if in_notebook_kernel():  # (the setting as now: standby(True) later is no warm-up)
        setting = os.environ.get("NBDDP_STANDBY")
        threading.Thread(target=lambda: importlib.import_module("._backends", __name__)
                         .warm_up(setting), daemon=True, name="nbddp-warm-up").start()


_warm_up_in_a_notebook()


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbddp`` registers the ``%%ddp`` cell magic."""
    from ._magic import load_ipython_extension as load

    load(ipython)
