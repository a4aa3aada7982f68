"""A Ray session's large payloads through Ray's object store, once per node.

The kernel puts the payload into the object store once (``ray.put``: one copy of the
tensors' bytes into shared memory on the kernel's node). Each node's agent is handed the
object: Ray moves it to that node's store (its object manager, node to node, in
parallel), and the agent writes it into the node's private shared-memory folder as an
nbddp data file, which the node's ranks map copy-on-write as on one machine. The node's
local rank 0 is then told to keep that file (``KeepPayload``), as when it came over the
channel: it drops it at the next run, and the node's folders go with torchrun.

Nothing secret goes into the object store: a payload is the user's code and data, and
it is readable there by the cluster's other jobs only through its ``ObjectRef``, which
nbddp hands to its own agents alone. The run's key never goes there (``_ray.agent``).
Objects are freed once every node has its copy (the reference is dropped).

It is the route for every payload that needs a data file (measured against the
channel's by size: docs/ray.md); ``NBDDP_SESSION_DATA=channel`` selects the channel.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from .._run.session.remote import PayloadDelivery
from .._wire import dataplane
from .._wire.channel import ChannelServer
from .._wire.dataplane import Packed
from .._wire.messages import KeepPayload
from .._wire.rundir import RunDir
from .._wire.transfer import Outgoing

OBJECT_STORE = "object_store"
"""The data route through Ray's object store (``NBDDP_SESSION_DATA``'s value)."""


class ObjectStoreDelivery(PayloadDelivery):
    """A payload put into Ray's object store once, which each node's agent writes into
    its node's shared memory (``keep_on(rank, ref)`` answers where); a node whose agent
    cannot gets it over the channel."""

    def __init__(self, payload: Packed, run_dir: RunDir, ray: ModuleType, route: str,
                 keep_on: Callable[[int, Any], str]) -> None:
        self._ray, self._keep_on = ray, keep_on
        self.ref: Any = None
        """The payload in the object store, until every node has it."""
        super().__init__(payload, run_dir, route)

    def _prepare(self, route: str) -> None:
        if route != OBJECT_STORE:
            super()._prepare(route)
            return
        assert self.payload is not None
        self.ref = self._ray.put(as_object(self.payload))

    def send_to(self, server: ChannelServer, rank: int) -> None:
        if self.ref is None:
            super().send_to(server, rank)
            return
        if rank in self._sent_to:
            return
        self._sent_to.add(rank)
        threading.Thread(target=self._keep, args=(server, rank, self.ref), daemon=True,
                         name="nbddp-payload").start()

    def _keep(self, server: ChannelServer, rank: int, ref: Any) -> None:
        """Have ``rank``'s node write the payload from the object store, then its local
        rank 0 keep it; over the channel where the agent could not."""
        try:
            file = self._keep_on(rank, ref)
        except Exception:  # noqa: BLE001 - an agent gone is said by the launcher
            payload = self.payload
            if payload is not None:
                with contextlib.suppress(OSError):
                    server.send(rank, KeepPayload(), self.outgoing or Outgoing(payload))
            return
        with contextlib.suppress(OSError):  # (a rank gone: the launcher says so)
            server.send(rank, KeepPayload(file=file))

    def release(self) -> None:
        super().release()
        self.ref = None  # (Ray frees the object)


def as_object(payload: Packed) -> tuple[bytes, list[Any]]:
    """The payload as Ray stores it without a copy of its own: the pickle, and each
    buffer as a NumPy view (which Ray's serializer writes out of band)."""
    import numpy as np

    return payload.data, [np.frombuffer(raw, dtype=np.uint8)
                          for raw in dataplane.raw_buffers(payload)]


def write_on_node(stored: tuple[bytes, list[Any]], folders: list[Path]) -> str:
    """(On a node, in its agent) The payload from the object store as a data file in
    ``folders`` (shared memory first, where it fits, else local disk); its path."""
    data, buffers = stored
    packed = Packed(data, list(buffers))
    folder = dataplane.place(dataplane.size_of(packed), folders[-1],
                             folders[0] if len(folders) > 1 else None)
    path = folder / f"payload-{secrets.token_hex(8)}.data"
    dataplane.write(path, packed)
    return str(path)
