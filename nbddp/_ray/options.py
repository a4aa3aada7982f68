"""What a Ray session asks of the cluster: the user's ``Ray`` choices, checked.

``Ray`` is what a user passes as ``cluster=`` to ``launch`` and ``Session``; the
``%%ddp --ray`` and ``%ddp_session start --ray`` flags fill one. ``ray_run`` turns it and
the run's options into the run's shape: ``nprocs`` (or ``gpus``) count ranks per node,
as on SLURM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from .._run.config import ClusterOptions, RunConfig, RunOptions
from .._run.flags import flag, no_flag


@dataclass(frozen=True)
class Ray(ClusterOptions):
    """Run the ranks on a Ray cluster: ``Session(nprocs=1, cluster=Ray(nodes=2))``.

    One placement group holds ``nodes`` bundles, no two on one node (``STRICT_SPREAD``),
    each with ``gpus_per_node`` GPUs and ``cpus_per_node`` CPUs; on each node a small
    agent actor runs torchrun with ``nprocs`` ranks (per node). ``address`` is Ray's
    (None: what ``ray.init()`` finds: ``RAY_ADDRESS``, then the cluster running on this
    machine); a ``ray://`` client address is refused, as the kernel must run inside the
    cluster (a head-node notebook). With ``grace`` (seconds) the ranks outlive the kernel
    that long, for ``Session.attach()`` in a new one; None: they end with the kernel.
    ``runtime_env`` is Ray's runtime environment for the agents, and so for torchrun and
    the ranks: ``working_dir`` (uploaded by Ray; the ranks run in it), ``py_modules``,
    ``pip``, ``env_vars``; the notebook's own modules ship without it.
    """

    nodes: int = field(default=2, metadata=no_flag("the magics' --nodes (any cluster's) "
                                                   "gives it"))
    """Ray nodes, one torchrun on each, joined by c10d rendezvous."""
    gpus_per_node: int = field(default=0, metadata=no_flag("--gpus N gives it (per node)"))
    """GPUs each node's bundle holds: the ranks see the ones Ray assigned."""
    cpus_per_node: float = field(default=1, metadata=flag(
        "with --ray: CPUs each node's bundle holds, for its torchrun and ranks (default 1)",
        type=float, metavar="N"))
    """CPUs each node's bundle holds, for its torchrun and ranks."""
    address: str | None = field(default=None, metadata=flag(
        "with --ray: the Ray cluster's address, HOST:PORT (default: RAY_ADDRESS, then the "
        "cluster started on this machine)", metavar="ADDR"))
    """The cluster's address (``host:port`` of its GCS, or ``auto``); None: ``ray.init``'s
    own choice."""
    grace: float | None = field(default=None, metadata=no_flag(
        "%ddp_session start --grace gives it"))
    """Seconds a session's ranks wait for a new kernel after theirs went (None: none)."""
    runtime_env: dict[str, Any] | None = field(default=None, hash=False, metadata=no_flag(
        "a dict of Ray's runtime_env keys: give it in Python, nbddp.Ray(runtime_env={...})"))
    """Ray's runtime environment for the agents, torchrun and the ranks (files, packages
    and variables beyond the notebook's own modules, which ship by themselves)."""

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"Ray(nodes=...) must be a positive int, got {self.nodes!r}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) \
                or self.gpus_per_node < 0:
            raise ValueError(f"Ray(gpus_per_node=...) must be an int, 0 or more, got "
                             f"{self.gpus_per_node!r}")
        if isinstance(self.cpus_per_node, bool) or not isinstance(
                self.cpus_per_node, (int, float)) or self.cpus_per_node <= 0:
            raise ValueError(f"Ray(cpus_per_node=...) must be a positive number, got "
                             f"{self.cpus_per_node!r}")
        if self.address is not None and not isinstance(self.address, str):
            raise TypeError(f"Ray(address=...) is a str or None, got {self.address!r}")
        if self.address is not None and self.address.startswith("ray://"):
            raise ValueError(
                f"Ray(address={self.address!r}) is a Ray Client address: nbddp needs the "
                "kernel inside the cluster (a notebook on the head node, or on a node "
                "that joined it), since the ranks connect back to it and large data "
                "crosses to them directly; give the cluster's GCS address (host:port) "
                "or leave address out")
        if self.grace is not None and (isinstance(self.grace, bool) or not isinstance(
                self.grace, (int, float)) or self.grace < 0):
            raise ValueError(f"Ray(grace=...) is a number of seconds, 0 or more (or None), "
                             f"got {self.grace!r}")

        _check_runtime_env(self.runtime_env)

    @property
    def working_dir(self) -> bool:
        """Ray uploads a working directory, where the ranks run."""
        return bool(self.runtime_env and self.runtime_env.get("working_dir"))

    @property
    def outlives_kernel(self) -> bool:
        return bool(self.grace)

    def bundle(self) -> dict[str, float]:
        """What each node's bundle of the placement group holds."""
        bundle: dict[str, float] = {"CPU": self.cpus_per_node}
        if self.gpus_per_node:
            bundle["GPU"] = self.gpus_per_node
        return bundle


def _check_runtime_env(runtime_env: Any) -> None:
    """A runtime environment is a dict of Ray's keys that a kernel that attaches can read
    back (JSON); Ray checks the values when it sets it up."""
    if runtime_env is None:
        return
    if not isinstance(runtime_env, dict) or not all(isinstance(k, str) for k in runtime_env):
        raise TypeError(f"Ray(runtime_env=...) is a dict of Ray's runtime_env keys "
                        f"(working_dir, py_modules, pip, env_vars, ...), got {runtime_env!r}")
    try:
        json.dumps(runtime_env)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"Ray(runtime_env=...) must hold plain values (str, list, dict: "
                        f"JSON), as Ray's does: {exc}") from None


def ray_run(options: RunOptions, ray: bool | Ray) -> tuple[RunConfig, Ray, int]:
    """A Ray run's shape: its config (every rank), the cluster's options, and the ranks
    per node (``nprocs`` or ``gpus``; default one)."""
    chosen = Ray() if ray is True else ray
    if not isinstance(chosen, Ray):
        raise TypeError(f"ray must be True or nbddp.Ray(...), got {ray!r}")
    per_node, gpus = options.per_node("ray")
    if gpus and chosen.gpus_per_node and gpus != chosen.gpus_per_node:
        raise ValueError(f"gpus={gpus} disagrees with Ray(gpus_per_node="
                         f"{chosen.gpus_per_node})")
    if gpus and not chosen.gpus_per_node:
        chosen = replace(chosen, gpus_per_node=gpus)
    if options.max_restarts:
        raise ValueError("a Ray run takes no max_restarts: its ranks keep a session's "
                         "state, which a restart would lose")
    return options.config(per_node * chosen.nodes), chosen, per_node
