"""A session's ranks on other machines: reached over TCP, handed each payload once per node.

What a session on a cluster (``_slurm``, ``_ray``) has whatever placed its ranks. They
reach the kernel's TCP channel (every frame authenticated with the run's key, see
``_wire.channel``) and wait there for each run, as a local session's ranks do. The
kernel cannot signal a rank on another node: it interrupts one, and asks for its stacks,
with a message. A run's payload crosses once per node (``PayloadDelivery``): each node's
local rank 0 keeps a copy on its node for the node's ranks to map.

The ranks may outlive their kernel (``outlives_kernel``): at the kernel's exit it then
only detaches (the channel closes, the address goes, the key stays), and a new kernel
attaches to them; otherwise it stops them. The backend says how the ranks are placed,
followed and stopped (its launcher), and how a kernel that attaches finds them.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import threading
from pathlib import Path
from typing import Any

from ..._errors import NbddpError
from ..._wire import dataplane
from ..._wire.channel import ChannelServer, tcp_address
from ..._wire.dataplane import Packed, shm_root
from ..._wire.messages import (
    Assigned,
    Failure,
    Interrupt,
    KeepPayload,
    OutputBytes,
    PayloadKept,
    RankOptions,
    Result,
    Start,
)
from ..._wire.rundir import RunDir, address_text, read_own_key
from ..._wire.transfer import Outgoing, place_in
from ..config import relay_tree
from ..groups.payload_place import with_payload_inside
from ..groups.shape import GroupShape, Handover
from ..groups.waiting import WaitingGroup
from ..records import Records

_OPEN: set[RemoteSessionGroup] = set()
_OPEN_LOCK = threading.Lock()


@atexit.register
def _leave_open_groups() -> None:
    """At the kernel's exit, detach from every session whose ranks wait for another
    kernel, and stop the others (also one still being placed)."""
    with _OPEN_LOCK:
        groups = list(_OPEN)
    for group in groups:
        if group.outlives_kernel and group.is_ready and group.gone is None:
            group.detach()
        else:
            group.stop()
            group.close()


class RemoteSessionGroup(WaitingGroup):
    """A session's ranks on ``nodes`` other machines (see the module's docstring)."""

    data_route = "filesystem"
    """How a payload too large for its Start reaches the nodes (``PayloadDelivery``)."""
    shares_filesystem = True
    """The nodes and the kernel share a filesystem (the session's folder): results'
    data files can come back through it, unless the payload came over the channel."""

    def __init__(self, shape: GroupShape, run_dir: RunDir, nodes: int) -> None:
        super().__init__(shape, run_dir)
        self.nodes = nodes
        self.names: tuple[str, ...] | None = None
        """The names rank 0's code has bound, as it says when a kernel attaches."""
        self._detached = False
        self._delivery: PayloadDelivery | None = None
        self._started: set[int] = set()  # the ranks sent this run's Start
        self._received: list[Path] = []  # results' data files that came over the channel
        with _OPEN_LOCK:
            _OPEN.add(self)

    @property
    def outlives_kernel(self) -> bool:
        """The ranks wait for another kernel once this one has gone."""
        return False

    def _listen(self, host: str) -> None:
        """The channel, on ``host``'s address, named in the run dir beside the key; a
        session cannot run without an address the nodes reach."""
        try:
            address = tcp_address(host)
        except ConnectionError as exc:
            raise NbddpError(f"{exc}; a session's ranks must reach the kernel: set "
                             "NBDDP_KERNEL_HOST to this machine's address on the cluster's "
                             "network") from None
        self._server = ChannelServer((address, 0), read_own_key(self.run_dir.path),
                                     self._deliver, inbox=place_in(shm_root(),
                                                                   self.run_dir.path),
                                     tree=relay_tree(self.nprocs // self.nodes, self.nodes))
        self.run_dir.replace_private(self.run_dir.address,
                                     address_text(address, self._server.port))

    # --- the payload, once per node -------------------------------------------------

    def _prepare_start(self, payload: Packed, records: Records, options: RankOptions,
                       handover: Handover) -> Start:
        """The run's Start: a small payload inside it; a larger one goes to each node's
        local rank 0 (``PayloadDelivery``), and each rank's Start names its node's copy.
        A result's data comes back the way the payload went."""
        start = self._start_message(self.run_dir.payload, records, options, handover)
        self._forget_received()
        with self._lock:
            self._started = set()
        inline = with_payload_inside(start, payload)
        if inline is not None:
            self._delivery = None
            return dataclasses.replace(inline, remote=not self.shares_filesystem)
        self._delivery = self._payload_delivery(payload)
        return dataclasses.replace(start, remote=not self.shares_filesystem
                                   or self._delivery.outgoing is not None)

    def _payload_delivery(self, payload: Packed) -> PayloadDelivery:
        """How this run's payload reaches each node."""
        return PayloadDelivery(payload, self.run_dir, self.data_route)

    def _send_starts(self, ranks: list[int]) -> None:
        """(Under the lock) A node's ranks start once it has the payload: those whose Start
        is known go together (once per node that has a relay); a node's local rank 0 is
        first sent the payload to keep, the node's other ranks wait for it."""
        assert self._server is not None and self._start is not None
        delivery = self._delivery
        if delivery is None:  # (the payload is inside the Start)
            self._started.update(ranks)
            self._server.send_to_each(ranks, self._start)
            return
        if delivery.cancelled:
            return  # (the run ended before these ranks' nodes had the payload)
        by_copy: dict[str, list[int]] = {}
        for rank in ranks:
            hello = self._hellos[rank]
            copy = delivery.copies.get(hello.node)
            if copy is not None:
                by_copy.setdefault(copy, []).append(rank)
            elif hello.local_rank == 0:
                delivery.send_to(self._server, rank)
        for copy, on_node in by_copy.items():
            self._started.update(on_node)
            self._server.send_to_each(on_node, dataclasses.replace(self._start, payload=copy))

    def _send_start(self, rank: int) -> None:
        self._send_starts([rank])

    def _payload_kept(self, kept: PayloadKept) -> None:
        """(Under the lock) A node has the payload: its ranks get their Start. A node that
        had no room maps the copy in the session's folder, written first if the payload
        came over the channel (on a thread of its own: this one reads the channel)."""
        delivery = self._delivery
        if delivery is None or kept.rank not in self._hellos:
            return
        node = self._hellos[kept.rank].node
        if kept.file or delivery.shared is not None:
            self._node_has(delivery, node, kept.file or str(delivery.shared))
        else:
            threading.Thread(target=self._share_for, args=(delivery, node, kept.rank),
                             daemon=True, name="nbddp-payload").start()

    def _node_has(self, delivery: PayloadDelivery, node: str, copy: str) -> None:
        """(Under the lock) ``node`` keeps the payload at ``copy``: its ranks start."""
        delivery.copies[node] = copy
        if len(delivery.copies) == self.nodes:
            delivery.release()
        self._send_starts([rank for rank, hello in self._hellos.items() if hello.node == node])

    def _share_for(self, delivery: PayloadDelivery, node: str, rank: int) -> None:
        """Write the payload into the session's folder for ``node``, which had no room
        for it; a run error naming the node if the folder has none either."""
        try:
            copy = str(delivery.write_shared())
        except OSError as exc:
            why = (f"node {node} has no room for the cell's data (in shared memory or on "
                   f"local disk), and the session's folder has none either: {exc}")
            self._put(Failure(rank, "NbddpError", "nbddp", why, why))
            return
        with self._lock:
            self._node_has(delivery, node, copy)

    def _forget_received(self) -> None:
        """Remove the data files of results that came but were never read (a run that
        failed or was interrupted after rank 0 returned)."""
        with self._lock:
            received, self._received = self._received, []
        for path in received:
            path.unlink(missing_ok=True)

    @property
    def detached(self) -> bool:
        """This kernel left the ranks to another kernel (``detach``)."""
        return self._detached

    def detach(self) -> None:
        """Leave the ranks running for a kernel to attach: stop following it, close the
        channel and remove its address (the ranks wait for another), keep the key. From
        then on ``stop`` and ``close`` leave the ranks alone (a run that ends as the
        channel closes must not stop them)."""
        self._detached = True
        self._release()
        if self._server is not None:
            self._server.close()
        self.run_dir.address.unlink(missing_ok=True)
        self._forget()

    def _release(self) -> None:
        """Stop following the ranks' launcher, and leave them running."""

    def interrupt(self, ranks: set[int]) -> None:
        """Ask each rank of ``ranks`` to raise ``KeyboardInterrupt`` in the user's code.
        A rank whose node did not yet have the payload never gets its Start: it is at
        rest, and says so (as a rank that returned nothing)."""
        assert self._server is not None
        with self._lock:
            if self._delivery is not None:
                self._delivery.cancelled = True
            waiting = {rank for rank in ranks if rank not in self._started}
        for rank in ranks - waiting:
            self._server.send(rank, Interrupt())
        for rank in sorted(waiting):
            self._put(Result(rank))

    def _took(self, message: Any) -> bool:
        if isinstance(message, Assigned) and self._start is None:
            self.names = message.names  # said to a kernel that attaches, before any run
        if isinstance(message, PayloadKept):
            self._payload_kept(message)
            return True
        if isinstance(message, Result) and message.file:
            self._received.append(Path(message.file))  # (removed if nobody reads it)
        if isinstance(message, OutputBytes):
            self._write_output(message)
            return True
        return super()._took(message)

    def _write_output(self, output: OutputBytes) -> None:
        """(Under the lock) A rank's output, sent from a node whose files the kernel
        cannot read: into the rank's log in the run's records, where it is read."""
        if self.records is None:
            return
        with contextlib.suppress(OSError), \
                open(self.records.rank_log(output.rank), "ab") as log:
            log.write(output.data)

    def stop(self, clean: bool = False) -> None:
        """Stop the ranks (``clean``: let them end by themselves first: the ranks at rest
        exit when the channel closes). Nothing, once detached."""
        if not self._detached:
            super().stop(clean)

    def close(self) -> None:
        if not self._detached:  # (the key stays for the kernel that attaches)
            super().close()
        self._forget_received()
        self._delivery = None

    def _forget(self) -> None:
        with _OPEN_LOCK:
            _OPEN.discard(self)



DATA_ROUTE_ENV = "NBDDP_SESSION_DATA"
"""How a cluster session's payloads reach the nodes: ``filesystem`` (the default: written
once to the session's folder, copied by each node) or ``channel`` (sent to each node)."""


class PayloadDelivery:
    """One run's payload, on its way to each node's local rank 0, which keeps a copy on
    its node (in shared memory where it fits) for the node's ranks to map: it crosses
    once per node. It goes one of two ways:

    - through the session's folder on the shared filesystem (the default): the kernel
      writes it there once, whatever the number of nodes, and each node copies it;
    - over the channel (``NBDDP_SESSION_DATA=channel``, or where the folder has no room
      for it): the kernel sends it to each node, hashed once (``_wire.transfer``).

    A node with no room for a copy maps the one in the session's folder."""

    def __init__(self, payload: Packed, run_dir: RunDir, route: str = "filesystem") -> None:
        self.payload: Packed | None = payload
        """The user's payload, until every node has it."""
        self.run_dir = run_dir
        self.shared: Path | None = None
        """The copy in the session's folder, once written."""
        run_dir.payload.unlink(missing_ok=True)  # (an earlier run's)
        self.outgoing: Outgoing | None = None
        self.copies: dict[str, str] = {}
        """Where each node keeps it, once it does."""
        self.cancelled = False
        """The run ended before every node had it: no more Starts go out."""
        self._sent_to: set[int] = set()
        self._prepare(os.environ.get(DATA_ROUTE_ENV, route))

    def _prepare(self, route: str) -> None:
        """Get the payload ready to go ``route``'s way."""
        assert self.payload is not None
        if route == "filesystem":
            with contextlib.suppress(OSError):  # (no room: over the channel, then)
                self.write_shared()
        if self.shared is None:
            self.outgoing = Outgoing(self.payload)

    def send_to(self, server: ChannelServer, rank: int) -> None:
        """Have ``rank`` (a node's local rank 0) keep it, once, in the background."""
        if rank in self._sent_to:
            return
        self._sent_to.add(rank)
        if self.shared is not None:
            server.send(rank, KeepPayload(copy_from=str(self.shared)))
        else:
            threading.Thread(target=server.send, args=(rank, KeepPayload(), self.outgoing),
                             daemon=True, name="nbddp-payload").start()

    def write_shared(self) -> Path:
        """The payload in the session's folder."""
        assert self.payload is not None  # (a node short of room comes before release)
        path = self.run_dir.payload
        dataplane.write(path, self.payload)
        self.shared = path
        return path

    def release(self) -> None:
        """Every node has it: let go of the user's tensors."""
        self.payload = self.outgoing = None
