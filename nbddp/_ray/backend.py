"""The Ray backend: a session as one placement group with torchrun on every node, a run
as a session of one cell, and attaching to a session from a new kernel.

``nprocs`` (or ``gpus``) count ranks per node. A session waits until Ray has placed its
group (saying what it waits for), then until every rank waits for its first run. With
``grace`` its ranks outlive the kernel that long, so ``Session.attach`` reconnects a new
kernel; without, they end with it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from .._errors import NbddpError
from .._run.backend import Backend, follow
from .._run.cluster_kind import Attached, ClusterKind, ClusterShape
from .._run.config import RunConfig, RunOptions
from .._run.flags import flag_values
from .._run.groups.shape import GroupShape
from .._run.groups.waiting import WaitingGroup
from .._run.job import Job
from .._run.records import FolderPerCell
from .._wire.dataplane import Packed
from .options import Ray, ray_run
from .session import RaySessionGroup, kept_ray_sessions, no_ray_session, still_placed

START_TIMEOUT = 300.0
"""How long the ranks may take to wait for their first run, once Ray placed them."""
ATTACH_WAIT = 30.0
"""How long a running session's ranks may take to reconnect to a kernel that attaches."""


class RayBackend(Backend):
    """Runs and sessions on a Ray cluster with ``options``, ``per_node`` ranks a node."""

    start_timeout = START_TIMEOUT
    ships_code = True

    def __init__(self, config: RunConfig, options: Ray, per_node: int) -> None:
        super().__init__(config)
        self.options, self.per_node = options, per_node

    def shape(self) -> GroupShape:
        """The shape of the ranks on the cluster's nodes: their GPUs, not this machine's."""
        return dataclasses.replace(GroupShape.of(self.config), cuda_visible_devices=None,
                                   gpus=self.options.gpus_per_node)

    def start_run(self, payload: Packed) -> Job:
        """A one-off run: a session's ranks, handed the run at once (each rank gets it as
        it comes up, once Ray placed them: the run waits, and Ctrl-C or its timeout
        stops it), and stopped after it."""
        group = self._group(dataclasses.replace(self.options, grace=None))
        return follow(group, self.config, payload)

    def session_group(self, standby: bool = True) -> WaitingGroup:
        return self._group(self.options)

    def _group(self, options: Ray) -> RaySessionGroup:
        return RaySessionGroup.start(self.shape(), options, self.per_node,
                                     dict(self.config.env or {}),
                                     {"timeout": self.config.timeout,
                                      "output": self.config.output})

    def wait_placed(self, group: WaitingGroup) -> bool:
        """Wait until Ray placed the group (unbounded: an autoscaler may add nodes;
        Ctrl-C stops; the group says what it waits for), then until every rank is
        ready."""
        assert isinstance(group, RaySessionGroup)
        while not group.placed and not group.broken:
            group.wait_ready(0.1)
        return group.wait_ready(self.start_timeout)

    def started(self, group: WaitingGroup) -> None:
        assert isinstance(group, RaySessionGroup)
        grace = self.options.grace
        lasts = (f"; they outlive this kernel for {grace:g} s: after a restart, "
                 f"%ddp_session attach (or nbddp.Session.attach()) reconnects"
                 if grace else "")
        print(f"nbddp: the session's ranks run on Ray: {group.where}{lasts}", flush=True)

    def place(self, group: WaitingGroup) -> str:
        return group.where

    def hosts(self, group: WaitingGroup, last: Job | None) -> dict[int, str]:
        return group.rank_nodes()

    def session_records(self) -> FolderPerCell:
        """A folder per cell, its ranks' logs made only as their output comes: the
        nodes cannot write there, the kernel writes what each rank sends (a no-op cell
        of many ranks then makes and prunes no file per rank)."""
        return FolderPerCell(self.config.nprocs, make_logs=False)

    def left(self, group: WaitingGroup) -> bool:
        return isinstance(group, RaySessionGroup) and group.detached


def ray_backend(options: RunOptions, ray: bool | Ray) -> RayBackend:
    """A one-off run's backend on Ray."""
    config, chosen, per_node = ray_run(options, ray)
    return RayBackend(config, chosen, per_node)


def attach_ray_session(session_id: str | None
                       ) -> tuple[RayBackend, RaySessionGroup, frozenset[str]]:
    """The backend and ranks of this account's Ray session ``session_id`` (without it:
    its one running Ray session), reconnected to this kernel with their state, and the
    names kept on them."""
    found = [(record, run_dir) for record, run_dir in kept_ray_sessions(session_id)
             if still_placed(record, run_dir) and record.options.outlives_kernel]
    if not found:
        raise no_ray_session(session_id)
    if len(found) > 1:
        listed = "\n".join(f"  {record.session_id}: {record.nprocs} ranks on "
                           f"{record.options.nodes} nodes, started "
                           f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(record.started))}"
                           for record, _ in found)
        raise NbddpError("several Ray sessions of this account may run; attach to one "
                         f"(%ddp_session attach ID):\n{listed}")
    record, run_dir = found[0]
    config = RunConfig(nprocs=record.nprocs, backend=record.backend, init=record.init,
                       timeout=record.timeout, output=record.output)
    backend = RayBackend(config, record.options, record.nprocs // record.options.nodes)
    try:
        group = RaySessionGroup.attached(backend.shape().unknown(), run_dir, record)
    except NbddpError:
        run_dir.remove()  # (its secrets: the session is gone, nobody attaches any more)
        raise
    try:
        ready = group.wait_ready(ATTACH_WAIT)
    except BaseException:
        group.detach()
        raise
    if not ready:
        group.detach()
        raise NbddpError(f"the ranks of Ray session {record.session_id} did not come within "
                         f"{ATTACH_WAIT:g} s: another kernel still attached to them keeps "
                         "them (stop or restart it first), or they are still finishing the "
                         "cell that was running")
    names = frozenset(group.names or ())
    print(f"nbddp: attached to Ray session {record.session_id} ({record.nprocs} ranks, "
          f"{len(names)} names kept on them)", flush=True)
    return backend, group, names


class RayKind(ClusterKind):
    """Ray, as the front door finds it: ``cluster=nbddp.Ray(...)``, ``--ray``."""

    name, title, options, job_word = "ray", "Ray", Ray, "placement"
    run_help = ("run the ranks on a Ray cluster's nodes (one placement group; --nodes N, "
                "--nprocs or --gpus ranks per node); the kernel must run inside the cluster")
    session_help = run_help

    def run_backend(self, options: RunOptions, chosen: Any) -> Backend:
        return ray_backend(options, chosen)

    def session_backend(self, options: RunOptions, chosen: Any,
                        grace: float | None) -> Backend:
        return ray_backend(options, _with_grace(chosen, grace))

    def attaches(self, job_id: str | int | None) -> bool:
        if job_id is None:
            return any(record.options.outlives_kernel for record, _ in kept_ray_sessions())
        return isinstance(job_id, str) and job_id.startswith("ray-")

    def attach_session(self, job_id: str | int | None) -> Attached:
        return attach_ray_session(None if job_id is None else str(job_id))

    def from_flags(self, parsed: Any, shape: ClusterShape) -> Any:
        return Ray(nodes=shape.nodes, gpus_per_node=shape.gpus_per_node or 0,
                   grace=shape.grace, **flag_values(Ray, parsed))


def _with_grace(ray: Ray, grace: float | None) -> Ray:
    """``ray`` with the session's ``grace`` (given once: here or in ``Ray``)."""
    if grace is None:
        return ray
    if ray.grace is not None and ray.grace != grace:
        raise ValueError(f"grace={grace:g} disagrees with Ray(grace={ray.grace:g})")
    return dataclasses.replace(ray, grace=grace)
