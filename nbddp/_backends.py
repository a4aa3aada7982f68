"""Where the front door finds a backend: the registry of cluster kinds.

``launch``, ``Session`` and the magics say what the user asked (``cluster=nbddp.Slurm()``,
``--ray``...) and get a ``Backend`` (``_run.backend``) to drive: this machine's, or the
one of the cluster kind whose option type the user gave. Each kind declares itself in
its own package (a ``ClusterKind``, see ``_run.cluster_kind``); this module lists them,
one line each. A new backend is its package and one ``register`` line (here, or in the
user's own code: the magics take its flags from then on).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from ._local.backend import local_backend, warm_up
from ._local.standby import StandbyState, standby
from ._ray.backend import RayKind
from ._ray.options import Ray
from ._run.backend import Backend
from ._run.cluster_kind import Attached, ClusterKind
from ._run.config import RunOptions
from ._run.job import Job
from ._slurm.backend import SlurmKind
from ._slurm.options import Slurm

__all__ = ["KINDS", "Ray", "Slurm", "StandbyState", "attach_run", "attached_session",
           "chosen_cluster", "kind_of", "register", "run_backend", "session_backend",
           "standby", "warm_up"]

KINDS: list[ClusterKind] = []
"""The cluster kinds, in the order they were registered (a session to attach to is
looked for in the reverse order: the last registered, the most particular, first)."""


def register(kind: ClusterKind) -> ClusterKind:
    """Make ``kind`` a cluster the front door knows: ``cluster=kind.options(...)`` and the
    magics' ``--<kind.name>`` (with its flags) choose it."""
    taken = [known for known in KINDS if known.name == kind.name
             or known.options is kind.options]
    if taken:
        raise ValueError(f"a cluster kind named {kind.name!r} (or taking "
                         f"{kind.options.__name__}) is registered already: {taken[0]!r}")
    KINDS.append(kind)
    return kind


register(SlurmKind())
register(RayKind())


def kind_of(cluster: Any) -> ClusterKind:
    """The kind whose option type ``cluster`` is; ``TypeError`` for anything else."""
    for kind in KINDS:
        if isinstance(cluster, kind.options):
            return kind
    names = ", ".join(f"nbddp.{kind.options.__name__}(...)" for kind in KINDS)
    raise TypeError(f"cluster= takes one of {names}, got {cluster!r}")


def chosen_cluster(cluster: Any, slurm: Any = False, ray: Any = False,
                   stacklevel: int = 3) -> Any:
    """The user's cluster from ``cluster=``, or from the older ``slurm=`` / ``ray=``
    (which still work, with a warning that names the new spelling); None: this machine."""
    old = [(name, value) for name, value in (("slurm", slurm), ("ray", ray))
           if value is not False]
    if len(old) + (cluster is not None) > 1:
        raise ValueError("a run goes to one cluster: give cluster=, not "
                         + " and ".join(f"{name}=" for name, _ in old)
                         + (" as well" if cluster is not None else " both"))
    if not old:
        return cluster
    name, value = old[0]
    kind = next(kind for kind in KINDS if kind.name == name)
    warnings.warn(f"{name}= is now cluster=: write cluster=nbddp.{kind.options.__name__}"
                  f"({'' if value is True else '...'}) ({name}= will go in a later release)",
                  DeprecationWarning, stacklevel=stacklevel)
    return kind.chosen(value)


def run_backend(options: RunOptions, cluster: Any = None) -> Backend:
    """The backend of a one-off run: this machine (``cluster=None``), or a cluster's."""
    if cluster is None:
        return local_backend(options)
    return kind_of(cluster).run_backend(options, cluster)


def session_backend(options: RunOptions, cluster: Any = None,
                    grace: float | None = None) -> Backend:
    """The backend of a session's ranks: this machine, or a cluster's, whose ranks may
    outlive the kernel for ``grace`` seconds (each kind says its default)."""
    if cluster is None:
        if grace is not None:
            raise ValueError("grace is for a session on a cluster (cluster=...): a local "
                             "session's ranks end with the kernel")
        return local_backend(options)
    return kind_of(cluster).session_backend(options, cluster, grace)


def attached_session(job_id: str | int | None) -> Attached:
    """The session whose ranks outlived their kernel, reconnected to this kernel: its
    backend, its ranks, and the names kept on them. ``job_id``: its cluster's id for it
    (a SLURM job, a Ray session ``ray-...``); without it, this account's one running
    session (the most particular kind's first: a Ray session's, where one is kept)."""
    for kind in reversed(KINDS):
        if kind.attaches(job_id):
            return kind.attach_session(job_id)
    raise ValueError(f"no cluster kind knows a session {job_id!r}")


def attach_run(job_id: str | int, run_dir: str | os.PathLike | None = None) -> Job:
    """A batch run followed again from a new kernel (a SLURM job's, by its id)."""
    for kind in reversed(KINDS):
        if kind.attaches(job_id) and type(kind).attach_run is not ClusterKind.attach_run:
            return kind.attach_run(job_id, run_dir)
    raise ValueError(f"no cluster kind follows a run {job_id!r} again")
