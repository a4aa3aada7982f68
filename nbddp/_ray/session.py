"""A session's ranks on a Ray cluster: torchrun on every node of a placement group.

``RaySessionGroup.start`` listens on the kernel's TCP channel, with a new key in the
session's folder (0600 in 0700, on the kernel's machine), and asks Ray for the
placement group; in the background it then waits until Ray placed it, starts an agent
on each node, and has each start its torchrun, handing it the key and the kernel's
address (see ``_ray.agent``). A session that replaces lost ranks starts one the same
way, and its next cell's ranks get their Start when they say hello. From there the
ranks are a remote session's (``_run.session.remote``): cells, payloads once per node
(through Ray's object store, ``_ray.object_store``: the nodes share no filesystem with
the kernel), results over the channel, interrupts and stacks by message.

With ``grace``, the placement group and agents are detached from the kernel's Ray job
and the ranks wait that long for a new kernel: at its exit the kernel only detaches, and
``attached`` reconnects a new one with what the session's folder keeps (the key, and the
``RaySessionRecord``). Only the user who can read that folder can attach.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from .._errors import NbddpError
from .._run.config import Output, relay_option
from .._run.groups.shape import GroupShape
from .._run.records import Records, folders, records_root
from .._run.session.remote import PayloadDelivery, RemoteSessionGroup
from .._wire.dataplane import Packed
from .._wire.handshake import new_key
from .._wire.rundir import RunDir, read_own_key
from .cluster import connect, kernel_address
from .object_store import OBJECT_STORE, ObjectStoreDelivery
from .options import Ray
from .placement import NodeInfo, NodeRefused, RayPlacement, held_group

RAY_SESSION = "ray-session.json"
"""In a Ray session's run folder: its placement group, agents and shape, for a kernel
that attaches to it."""


@dataclass(frozen=True)
class RaySessionRecord:
    """What a kernel that attaches needs to know of a Ray session: its id (which names
    its placement group and agents), its options and shape, and its own settings."""

    session_id: str
    options: Ray
    nprocs: int
    backend: str | None
    init: bool
    timeout: float | None
    output: Output
    started: float
    """When the session started (seconds since the epoch)."""
    placement_group: str = ""
    """Its placement group's id (hex): found by id, from whatever namespace."""

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def read(cls, run_dir: RunDir) -> RaySessionRecord:
        fields = json.loads((run_dir.path / RAY_SESSION).read_text())
        return cls(options=Ray(**fields.pop("options")), **fields)


_PLACE_POLL = 0.5  # seconds between two looks at a placement Ray has not made yet
_SAY_AFTER = 2.0  # a placement that takes longer says what it waits for, once
_PLACING_JOIN = 90.0  # the background placement's steps: each bounded, all within this


class RaySessionGroup(RemoteSessionGroup):
    """A session's ranks on a Ray cluster: ``start`` them, or attach to running ones."""

    launcher_name = "the Ray agents"
    data_route = OBJECT_STORE
    shares_filesystem = False

    def __init__(self, shape: GroupShape, options: Ray, per_node: int, run_dir: RunDir,
                 session_id: str, env: dict[str, str] | None = None) -> None:
        super().__init__(shape, run_dir, options.nodes)
        self.options, self.per_node, self.session_id = options, per_node, session_id
        self.env = dict(env or {})
        """What the ranks' environment adds to their node's own: the user's ``env``."""
        self.placement: RayPlacement | None = None
        self.where, self.cluster_job_id = f"Ray session {session_id}", session_id
        self._stop_placing = threading.Event()
        self._placing: threading.Thread | None = None
        self.placement_error: str | None = None
        """Why Ray could not place the group, or start its agents, if so."""

    @property
    def outlives_kernel(self) -> bool:
        return self.options.outlives_kernel

    @classmethod
    def start(cls, shape: GroupShape, options: Ray, per_node: int, env: dict[str, str],
              settings: dict[str, Any]) -> RaySessionGroup:
        """Listen, and ask Ray for the session's placement group (``env``: what the
        ranks' environment adds to their node's; ``settings``: the session's own, kept
        for a kernel that attaches: ``timeout``, ``output``)."""
        ray = connect(options.address)
        sweep_ended_sessions()
        session_id = f"ray-{secrets.token_hex(4)}"
        group = cls(shape, options, per_node, RunDir.of_job(Records.create().path),
                    session_id, env)
        try:
            group.run_dir.write_private(group.run_dir.key, new_key())
            group._listen(kernel_address(ray))
            group.placement = RayPlacement.request(ray, session_id, options)
            group.run_dir.write_private(group.run_dir.path / RAY_SESSION, RaySessionRecord(
                session_id, options, shape.nprocs, shape.backend, shape.init,
                started=time.time(), placement_group=group.placement.group_id,
                **settings).to_json())
            group._place_in_background()
        except BaseException:
            group.stop()
            group.close()
            raise
        return group

    @property
    def placed(self) -> bool:
        """Ray placed the group, and every node's torchrun was started."""
        return self.launcher is not None

    def _place_in_background(self) -> None:
        self._placing = threading.Thread(target=self._place, daemon=True,
                                         name="nbddp-ray-placement")
        self._placing.start()

    def _place(self) -> None:
        """Once Ray placed the group, start an agent on each node, and each node's
        torchrun (a group stopped meanwhile starts nothing more); a failure breaks the
        group, saying why."""
        placement = self.placement
        assert placement is not None
        asked, said = time.monotonic(), False
        try:
            while not placement.wait_placed(_PLACE_POLL):
                if self._stop_placing.is_set():
                    return
                if not said and time.monotonic() - asked > _SAY_AFTER:
                    said = True
                    print(f"nbddp: {placement.describe_wait()}", flush=True)
            self._placed_on(placement.start_agents())
            if self._stop_placing.is_set():
                return
            placement.start_torchrun(
                read_own_key(self.run_dir.path), self.run_dir.address.read_bytes(),
                self._torchrun_args(placement), self._worker_args(), self.env,
                None if self.options.working_dir else self.shape.cwd)
        except NodeRefused as exc:
            self.refusal = str(exc)
            self._placement_failed(str(exc))
            return
        except NbddpError as exc:  # (said in full: no type name needed)
            self._placement_failed(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - Ray's errors, said as the group's end
            self._placement_failed(f"{type(exc).__name__}: {exc}")
            return
        with self._lock:
            if self._stop_placing.is_set():
                return
            self._follow_launcher(placement)

    def _placed_on(self, nodes: list[NodeInfo]) -> None:
        self.where = f"Ray session {self.session_id} on {', '.join(n.name for n in nodes)}"

    def _placement_failed(self, why: str) -> None:
        self.placement_error = why
        with self._lock:
            self.broken = True
            self._lose(f"the Ray placement failed ({why})")
        self._changed()

    def _payload_delivery(self, payload: Packed) -> PayloadDelivery:
        """Through Ray's object store, each node's agent writing it into its node's
        shared memory (``NBDDP_SESSION_DATA=channel``: over nbddp's channel)."""
        assert self.placement is not None
        return ObjectStoreDelivery(payload, self.run_dir, self.placement.ray,
                                   self.data_route, self._keep_on)

    def _keep_on(self, rank: int, ref: Any) -> str:
        assert self.placement is not None
        with self._lock:
            node = self._hellos[rank].node
        return self.placement.keep_payload(node, ref)

    def launcher_tail(self, lines: int = 30) -> str:
        """What the agents' torchruns said last (or why the placement failed)."""
        if self.placement_error is not None:
            return self.placement_error
        if self.placement is None:
            return "(nothing)"
        return self.placement.tails(lines) or "(nothing)"

    def _torchrun_args(self, placement: RayPlacement) -> list[str]:
        # (nbddp's torchrun's own options, before torchrun's)
        return [*relay_option(self.per_node, self.options.nodes),
                "--nnodes", str(self.options.nodes), "--nproc-per-node", str(self.per_node),
                "--max-restarts", "0", "--rdzv-backend", "c10d",
                "--rdzv-id", f"nbddp-{self.session_id}",
                "--rdzv-endpoint", placement.rendezvous()]

    def _worker_args(self) -> list[str]:
        return ["--remote", *(["--prepare", self.shape.prepare] if self.shape.prepare else []),
                "--grace", f"{self.options.grace or 0:g}",
                "--relay-output"]  # (the nodes cannot write to the kernel's records)

    @classmethod
    def attached(cls, shape: GroupShape, run_dir: RunDir,
                 record: RaySessionRecord) -> RaySessionGroup:
        """Listen anew, and tell the ranks of a running session (through their agents)
        where: they connect as soon as their last kernel has gone."""
        ray = connect(record.options.address)
        group = cls(shape, record.options, record.nprocs // record.options.nodes, run_dir,
                    record.session_id)
        try:
            group.placement = RayPlacement.found(ray, record.session_id, record.options,
                                                 record.placement_group)
            group._placed_on(group.placement.nodes)
            group._listen(kernel_address(ray))
            group.placement.attach(group.run_dir.address.read_bytes())
            group._follow_launcher(group.placement)
        except BaseException:
            group.detach()
            raise
        return group

    def _release(self) -> None:
        if self.placement is not None:
            self.placement.release()

    def stop(self, clean: bool = False) -> None:
        """Stop every node's torchrun and remove the placement group (also one not yet
        placed). Nothing, once detached."""
        if self._detached:
            return
        with self._lock:
            self._stop_placing.set()
            followed = self.launcher is not None
        if not followed and self.placement is not None:
            if self._placing is not None:  # (each of its steps is bounded: once it is
                self._placing.join(_PLACING_JOIN)  # done, nothing more starts)
            self.placement.stop()  # (not placed, or placed as it was stopped)
        super().stop(clean)


def kept_ray_sessions(session_id: str | None = None
                      ) -> list[tuple[RaySessionRecord, RunDir]]:
    """This account's Ray sessions whose folder keeps the key (they may still run),
    oldest first; only ``session_id``'s if given. Whether Ray still holds them is for
    ``still_placed`` to say."""
    found = []
    for folder in folders(records_root()):
        run_dir = RunDir.of_job(folder)
        if not (run_dir.path / RAY_SESSION).exists():
            continue
        try:
            read_own_key(folder)  # (a folder anyone else made or can write to is not)
            record = RaySessionRecord.read(run_dir)
        except (OSError, ValueError, TypeError):
            continue
        if session_id is None or record.session_id == session_id:
            found.append((record, run_dir))
    return found


def still_placed(record: RaySessionRecord, run_dir: RunDir) -> bool:
    """Whether Ray still holds the session's placement group; if not, its folder's
    secrets go (a kernel that died could not remove them; nobody can attach now)."""
    ray = connect(record.options.address)
    if not record.placement_group or held_group(ray, record.placement_group) is not None:
        return True  # (no id: an earlier nbddp's session, left as it is)
    run_dir.remove()
    return False


def sweep_ended_sessions() -> None:
    """Remove the secrets of this account's Ray sessions that Ray no longer holds (their
    kernel died before it could)."""
    for record, run_dir in kept_ray_sessions():
        with contextlib.suppress(Exception):  # (another cluster, unreachable: left)
            still_placed(record, run_dir)


def no_ray_session(session_id: str | None) -> NbddpError:
    which = f"Ray session {session_id} is not" if session_id else "no Ray session is"
    return NbddpError(f"{which} running for this account (under {records_root()}); start "
                      "one with %ddp_session start --ray")
