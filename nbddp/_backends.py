"""Where the front door chooses a backend: the one module of it that names them.

``launch``, ``Session`` and the magics say what the user asked (``slurm=``, ...) and get
a ``Backend`` (``_run.backend``) to drive; attaching finds the backend that holds the
session. A new backend is a package beside ``_local`` and ``_slurm`` and a few lines
here (and its option in the public signatures).
"""

from __future__ import annotations

from ._local.backend import local_backend, warm_up
from ._local.standby import StandbyState, standby
from ._run.backend import Backend
from ._run.config import RunOptions
from ._run.waiting import WaitingGroup
from ._slurm.backend import attach_run, attach_session, slurm_backend, slurm_session_backend
from ._slurm.options import Slurm

__all__ = ["Slurm", "StandbyState", "attach_run", "attached_session", "run_backend",
           "session_backend", "standby", "warm_up"]


def run_backend(options: RunOptions, slurm: bool | Slurm = False) -> Backend:
    """The backend of a one-off run: this machine, or a SLURM batch job."""
    if slurm is not False:
        return slurm_backend(options, slurm)
    return local_backend(options)


def session_backend(options: RunOptions, slurm: bool | Slurm = False,
                    grace: float | None = None) -> Backend:
    """The backend of a session's ranks: this machine, or one SLURM job (whose ranks
    outlive the kernel for ``grace`` seconds)."""
    if slurm is not False:
        return slurm_session_backend(options, slurm, grace)
    if grace is not None:
        raise ValueError("grace is for a session on SLURM (slurm=...): a local "
                         "session's ranks end with the kernel")
    return local_backend(options)


def attached_session(job_id: str | int | None
                     ) -> tuple[Backend, WaitingGroup, frozenset[str]]:
    """The session whose ranks outlived their kernel (its SLURM job ``job_id``, or this
    account's one running session), reconnected to this kernel: its backend, its ranks,
    and the names kept on them."""
    return attach_session(job_id)
