"""A Ray session's nodes, from the kernel: one placement group, one agent per bundle.

Ray places and supervises; nbddp asks it for one placement group of ``nodes`` bundles,
``STRICT_SPREAD`` (no two on one node), each holding the CPUs and GPUs asked for, and
starts one ``NodeAgent`` in each bundle, which starts the node's torchrun. The first
agent's node hosts the c10d rendezvous, on a port free there.

``RayPlacement`` is the group's launcher (``_run.groups.group.Launcher``): ``wait`` returns once
every node's torchrun has ended, or at once when one failed, an agent died (killed, its
node lost) or the placement group was removed; ``stopped_from_outside`` then says which
node and why. ``stop`` has each agent stop its torchrun and clean its node, then removes
the placement group, which ends the agents: nothing of the session is left.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .._errors import NbddpError
from .._version import __version__
from .._wire.versions import EVERY_NODE_NEEDS
from .agent import NodeAgent
from .cluster import NAMESPACE
from .options import Ray
from .runtime_env import for_actors

logger = logging.getLogger(__name__)

_STOP_WAIT = 20.0  # the agents' own stop: SIGTERM, then SIGKILL after 5 s
_CALL_WAIT = 30.0  # a call to an agent that should answer at once
_START_WAIT = 300.0
"""How long a new agent may take to answer first: Ray starts a worker process for it,
which imports nbddp (slow on a node whose cores are busy)."""
_SETUP_WAIT = 600.0
"""How long Ray may take to set up the agents' runtime environment (a ``pip`` list to
install, a ``working_dir`` to upload) before they answer."""
_POLL = 0.5
_PROBE_WAIT = 3.0  # an agent asked where it runs answers in milliseconds, if it can
_KEEP_WAIT = 3600.0  # a payload fetched from another node's object store: GBs, over TCP


@dataclass(frozen=True)
class NodeInfo:
    """Where one agent runs: Ray's node id, its address, and the name its ranks give it."""

    node_id: str
    ip: str
    name: str


def placement_name(session_id: str) -> str:
    return f"nbddp-{session_id}"


def agent_name(session_id: str, index: int) -> str:
    return f"nbddp-{session_id}-agent-{index}"


class RayPlacement:
    """The placement group and agents of session ``session_id`` (see the module's
    docstring); ``request`` asks Ray for them, ``found`` finds those of a running one."""

    def __init__(self, ray: ModuleType, session_id: str, options: Ray, group: Any,
                 agents: list[Any]) -> None:
        self.ray, self.session_id, self.options = ray, session_id, options
        self.placement_group = group
        self.agents = agents
        self.nodes: list[NodeInfo] = []
        self._released = threading.Event()
        self._stopped = False
        self._lost: str | None = None

    @classmethod
    def request(cls, ray: ModuleType, session_id: str, options: Ray) -> RayPlacement:
        """Ask Ray for the placement group (placed later: ``wait_placed``)."""
        from ray.util.placement_group import placement_group

        group = placement_group([options.bundle()] * options.nodes, strategy="STRICT_SPREAD",
                                name=placement_name(session_id), lifetime=_lifetime(options))
        return cls(ray, session_id, options, group, [])

    @property
    def group_id(self) -> str:
        """The placement group's id, which finds it from any driver (its name is known
        only in the namespace of the driver that made it: a notebook's own ``ray.init``
        puts that in a namespace of its own)."""
        return self.placement_group.id.hex()

    @classmethod
    def found(cls, ray: ModuleType, session_id: str, options: Ray,
              group_id: str) -> RayPlacement:
        """The placement group (``group_id``) and agents of a running session (a kernel
        that attaches); NbddpError if they are gone."""
        gone = NbddpError(f"the Ray session {session_id} is gone (its placement group or "
                          "an agent no longer exists)")
        group = held_group(ray, group_id)
        if group is None:
            raise gone
        try:
            agents = [ray.get_actor(agent_name(session_id, index), namespace=NAMESPACE)
                      for index in range(options.nodes)]
        except ValueError:
            raise gone from None
        placement = cls(ray, session_id, options, group, agents)
        placement.nodes = placement._where()
        return placement

    def wait_placed(self, timeout: float) -> bool:
        """Whether Ray placed every bundle within ``timeout`` seconds."""
        ready, _ = self.ray.wait([self.placement_group.ready()], timeout=timeout)
        return bool(ready)

    def describe_wait(self) -> str:
        """What the placement waits for, and what the cluster has."""
        alive = [node for node in self.ray.nodes() if node.get("Alive")]
        return (f"waiting for Ray to place {self.options.nodes} bundles of "
                f"{self.options.bundle()} on distinct nodes (the cluster has "
                f"{len(alive)} node{'s' * (len(alive) != 1)} alive: {_free(self.ray)}); "
                "Ctrl-C cancels")

    def start_agents(self) -> list[NodeInfo]:
        """One agent in each bundle; where each runs."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = _actor_class(self.ray)
        runtime_env = self.options.runtime_env and for_actors(self.ray,
                                                              self.options.runtime_env)
        for index in range(self.options.nodes):
            self.agents.append(actor.options(
                name=agent_name(self.session_id, index), namespace=NAMESPACE,
                lifetime=_lifetime(self.options), num_cpus=self.options.cpus_per_node,
                num_gpus=self.options.gpus_per_node, max_concurrency=8, max_restarts=0,
                **({"runtime_env": runtime_env} if runtime_env else {}),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=index),
            ).remote(index, self.options.outlives_kernel))
        try:
            self.nodes = self._where(_SETUP_WAIT if runtime_env else _START_WAIT)
        except Exception as exc:
            missing = self._nbddp_missing(exc)
            if missing is not None:
                raise NodeRefused(missing) from None
            raise
        return self.nodes

    def _nbddp_missing(self, error: BaseException) -> str | None:
        """What to tell the user if an agent failed as nbddp cannot be imported on its
        node (which is named: the node its bundle was placed on)."""
        said = str(error)
        if "No module named 'nbddp" not in said:
            return None
        agent = re.search(r"-agent-(\d+)", said)
        name = self._node_of(int(agent.group(1))) if agent else "a node"
        return (f"nbddp cannot be imported on {name} (ModuleNotFoundError: No module named "
                f"'nbddp'): {EVERY_NODE_NEEDS} (nbddp {__version__} here). Install it in "
                "the nodes' image: one image for the kernel and every node")

    def _node_of(self, index: int) -> str:
        """The Ray node bundle ``index`` was placed on, as the user can find it."""
        with contextlib.suppress(Exception):
            from ray.util.placement_group import placement_group_table

            node_id: str = placement_group_table(
                self.placement_group)["bundles_to_node_id"][index]
            hosts = {n["NodeID"]: n.get("NodeManagerHostname", "") for n in self.ray.nodes()}
            if node_id in hosts:
                return f"Ray node {hosts[node_id]}:{node_id[:8]}"
        return f"the node of bundle {index}"

    def _where(self, wait: float = _CALL_WAIT) -> list[NodeInfo]:
        """Where each agent runs, each answering within ``wait`` seconds (a new one
        first starts); NbddpError naming the nodes whose agents did not answer."""
        calls = [agent.where.remote() for agent in self.agents]
        _, late = self.ray.wait(calls, num_returns=len(calls), timeout=wait)
        if late:
            nodes = ", ".join(self._node_of(calls.index(call)) for call in late)
            raise NbddpError(
                f"the nbddp agent on {nodes} did not answer within {wait:g} s (Ray did "
                "not start its worker: is that node overloaded, or out of memory? "
                "`ray status` and the node's raylet.out say more)")
        return [NodeInfo(answer["node_id"], answer["ip"], answer["name"])
                for answer in self.ray.get(calls)]

    def rendezvous(self) -> str:
        """``host:port`` of the c10d rendezvous: a port free on the first agent's node."""
        port = self.ray.get(self.agents[0].free_port.remote(), timeout=_CALL_WAIT)
        return f"{self.nodes[0].ip}:{port}"

    def start_torchrun(self, key: bytes, address: bytes, torchrun_args: list[str],
                       worker_args: list[str], env: dict[str, str], cwd: str | None) -> None:
        """Each node's torchrun (the first hosts the rendezvous store)."""
        self.ray.get([agent.start.remote(
            key, address, [*torchrun_args, "--rdzv-conf", f"is_host={int(index == 0)}"],
            worker_args, env, cwd) for index, agent in enumerate(self.agents)],
            timeout=_CALL_WAIT)

    def keep_payload(self, node: str, ref: Any) -> str:
        """Have ``node``'s agent write the payload in the object store (``ref``) into the
        node's shared memory: the file's path there."""
        index = next(i for i, info in enumerate(self.nodes) if info.name == node)
        return self.ray.get(self.agents[index].keep.remote(ref), timeout=_KEEP_WAIT)

    def tails(self, lines: int = 30) -> str:
        """The end of each node's torchrun log, as its agent says it."""
        said = []
        for node, agent in zip(self.nodes, self.agents, strict=False):
            with contextlib.suppress(Exception):
                tail = self.ray.get(agent.tail.remote(lines), timeout=_CALL_WAIT)
                said.append(f"--- node {node.name} ---\n{tail}")
        return "\n".join(said)

    def attach(self, address: bytes) -> None:
        """A new kernel listens at ``address``: every node's ranks are told."""
        self.ray.get([agent.attach.remote(address) for agent in self.agents],
                     timeout=_CALL_WAIT)

    # --- the Launcher protocol ------------------------------------------------------

    def add_rank(self, pid: int) -> None:
        """Ranks run on the cluster's nodes: their agents stop them, not their PIDs."""

    def wait(self) -> int:
        """Block until every node's torchrun has ended, or one failed, or an agent is
        gone (``release``: at once); the exit code (1 for a lost agent)."""
        pending = {agent.wait.remote(): index for index, agent in enumerate(self.agents)}
        code = 0
        while pending and not self._released.is_set():
            done, _ = self.ray.wait(list(pending), num_returns=1, timeout=_POLL)
            for ref in done:
                index = pending.pop(ref)
                try:
                    code, _tail = self.ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - RayActorError and its kin
                    self._lost = self._why_gone(index, exc)
                    return 1
                if code != 0:
                    return code
        return code

    def release(self) -> None:
        """Stop following the agents (a kernel that detached): ``wait`` returns."""
        self._released.set()

    def stopped_from_outside(self) -> str | None:
        """Why the ranks were stopped from outside, if they were: a node lost, an agent
        killed, the placement group removed. Asked when a rank's link closed without a
        report: if Ray has not said yet that an agent is gone (a node whose every
        process died at once is declared dead only after Ray's health checks fail, tens
        of seconds later), each agent is asked to answer at once, and the node of one
        that cannot, and whose raylet does not answer either, is taken as lost."""
        if self._stopped:
            return None
        if self._lost is None and self.agents:
            with contextlib.suppress(Exception):  # (Ray's own failure: nothing to add)
                self._lost = self._unanswered()
        return self._lost

    def _unanswered(self) -> str | None:
        """Why an agent that does not answer within ``_PROBE_WAIT`` is gone, if one
        does not (a slow agent on a live node is no loss)."""
        calls = [agent.where.remote() for agent in self.agents]
        ready, _ = self.ray.wait(calls, num_returns=len(calls), timeout=_PROBE_WAIT)
        for index, call in enumerate(calls):
            node = self.nodes[index] if index < len(self.nodes) else None
            if call not in ready:
                if node is not None and not _raylet_alive(self.ray, node.node_id):
                    return f"Ray node {node.name} was lost (its raylet is gone)"
                continue
            try:
                self.ray.get(call, timeout=0)
            except Exception as exc:  # noqa: BLE001 - RayActorError and its kin
                return self._why_gone(index, exc)
        return None

    def stop(self, clean: bool = False) -> None:
        """Each agent stops its node's torchrun and cleans its node; then the placement
        group goes, and the agents with it."""
        self._stopped = True
        from ray.util.placement_group import remove_placement_group

        calls = [agent.stop.remote() for agent in self.agents]
        with contextlib.suppress(Exception):
            self.ray.wait(calls, num_returns=len(calls), timeout=_STOP_WAIT)
        for agent in self.agents:  # (a detached agent outlives its placement group's
            with contextlib.suppress(Exception):  # removal until it is killed)
                self.ray.kill(agent, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(self.placement_group)
        self._released.set()

    def _why_gone(self, index: int, error: BaseException) -> str:
        """Why agent ``index`` is gone: its node was lost, the placement group was
        removed, or the agent itself was killed."""
        node = self.nodes[index] if index < len(self.nodes) else None
        name = node.name if node else f"#{index}"
        if node is not None and not _raylet_alive(self.ray, node.node_id):
            return f"Ray node {name} was lost (its raylet is gone)"
        if _placement_removed(self.placement_group):
            return ("the session's Ray placement group was removed from outside "
                    f"(remove_placement_group), which ended the agent of node {name}")
        logger.info("nbddp: the agent of Ray node %s is gone: %s", name, error)
        return (f"the nbddp agent of Ray node {name} died (killed with ray.kill, or its "
                "process ended)")


class NodeRefused(RuntimeError):
    """A node of the placement cannot run nbddp's agent: what to do is the message."""


_ACTOR: Any = None


def _actor_class(ray: ModuleType) -> Any:
    """``NodeAgent`` as a Ray actor class (made once, in the kernel)."""
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = ray.remote(NodeAgent)
    return _ACTOR


def _lifetime(options: Ray) -> str | None:
    """A session that outlives its kernel keeps its placement group and agents:
    ``detached`` (else Ray removes them with the kernel's job)."""
    return "detached" if options.outlives_kernel else None


def _raylet_alive(ray: ModuleType, node_id: str) -> bool:
    """Whether Ray counts the node alive and its raylet takes a connection: a node whose
    every process died at once (an evicted pod, a dead machine) is declared dead by Ray
    only once its health checks have failed for a while, but its raylet's port is
    closed (or silent) at once."""
    with contextlib.suppress(Exception):
        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                if not node.get("Alive"):
                    return False
                address = (node["NodeManagerAddress"], int(node["NodeManagerPort"]))
                with socket.create_connection(address, timeout=_PROBE_WAIT):
                    return True
    return False


def held_group(ray: ModuleType, group_id: str) -> Any | None:
    """The placement group ``group_id`` (hex), if Ray still holds it (made, not removed)."""
    from ray.util.placement_group import PlacementGroup

    try:
        group = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id)))
    except ValueError:  # (not an id)
        return None
    return None if _group_state(group) in (None, "REMOVED") else group


def _placement_removed(group: Any) -> bool:
    return _group_state(group) == "REMOVED"


def _group_state(group: Any) -> str | None:
    """The placement group's state in Ray's table; None if Ray has no such group, or
    could not say."""
    from ray.util.placement_group import placement_group_table

    with contextlib.suppress(Exception):
        return placement_group_table(group).get("state")
    return None


def _free(ray: ModuleType) -> str:
    """The cluster's free resources, briefly: ``CPU 1/2, GPU 0/0``."""
    with contextlib.suppress(Exception):
        free, total = ray.available_resources(), ray.cluster_resources()
        return ", ".join(f"{name} {free.get(name, 0):g}/{total.get(name, 0):g} free"
                         for name in ("CPU", "GPU") if total.get(name))
    return "resources unknown"
