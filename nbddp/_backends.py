"""Where the front door chooses a backend: the one module of it that names them.

``launch``, ``Session`` and the magics say what the user asked (``slurm=``, ``ray=``) and get
a ``Backend`` (``_run.backend``) to drive; attaching finds the backend that holds the
session. A new backend is a package beside ``_local``, ``_slurm`` and ``_ray`` and a
few lines here (and its option in the public signatures).
"""

from __future__ import annotations

import dataclasses

from ._local.backend import local_backend, warm_up
from ._local.standby import StandbyState, standby
from ._ray.backend import attach_ray_session, ray_backend
from ._ray.options import Ray
from ._ray.session import kept_ray_sessions
from ._run.backend import Backend
from ._run.config import RunOptions
from ._run.waiting import WaitingGroup
from ._slurm.backend import attach_run, attach_session, slurm_backend, slurm_session_backend
from ._slurm.options import Slurm

__all__ = ["Ray", "Slurm", "StandbyState", "attach_run", "attached_session", "run_backend",
           "session_backend", "standby", "warm_up"]


def run_backend(options: RunOptions, slurm: bool | Slurm = False,
                ray: bool | Ray = False) -> Backend:
    """The backend of a one-off run: this machine, a SLURM batch job, or Ray's nodes."""
    _one_cluster(slurm, ray)
    if slurm is not False:
        return slurm_backend(options, slurm)
    if ray is not False:
        return ray_backend(options, ray)
    return local_backend(options)


def session_backend(options: RunOptions, slurm: bool | Slurm = False,
                    grace: float | None = None, ray: bool | Ray = False) -> Backend:
    """The backend of a session's ranks: this machine, one SLURM job (whose ranks
    outlive the kernel for ``grace`` seconds), or a Ray placement group (``Ray.grace``,
    or ``grace``)."""
    _one_cluster(slurm, ray)
    if slurm is not False:
        return slurm_session_backend(options, slurm, grace)
    if ray is not False:
        return ray_backend(options, _with_grace(ray, grace))
    if grace is not None:
        raise ValueError("grace is for a session on a cluster (slurm=... or ray=...): a "
                         "local session's ranks end with the kernel")
    return local_backend(options)


def attached_session(job_id: str | int | None
                     ) -> tuple[Backend, WaitingGroup, frozenset[str]]:
    """The session whose ranks outlived their kernel, reconnected to this kernel: its
    backend, its ranks, and the names kept on them. ``job_id``: its SLURM job, or its
    Ray session (``ray-...``); without it, this account's one running session (a Ray
    session's, where its folder is kept; else a SLURM job's)."""
    if isinstance(job_id, str) and job_id.startswith("ray-"):
        return attach_ray_session(job_id)
    if job_id is None and any(record.options.outlives_kernel
                              for record, _ in kept_ray_sessions()):
        return attach_ray_session(None)
    return attach_session(job_id)


def _one_cluster(slurm: bool | Slurm, ray: bool | Ray) -> None:
    if slurm is not False and ray is not False:
        raise ValueError("a run goes to one cluster: give slurm= or ray=, not both")


def _with_grace(ray: bool | Ray, grace: float | None) -> bool | Ray:
    """``ray`` with the session's ``grace`` (given once: here or in ``Ray``)."""
    if grace is None:
        return ray
    chosen = Ray() if ray is True else ray
    if isinstance(chosen, Ray):
        if chosen.grace is not None and chosen.grace != grace:
            raise ValueError(f"grace={grace:g} disagrees with Ray(grace={chosen.grace:g})")
        return dataclasses.replace(chosen, grace=grace)
    return ray
