"""A SLURM session's rank: its link to a kernel that may go, and to the next that attaches.

A session's ranks on a cluster outlive their kernel (a restart, a crash) for a grace
period, with their state, so that a new kernel can attach to them. The kernel's TCP
address is in the session's folder, beside the key (both private to the user); a
kernel that attaches listens anew and replaces the address. A rank whose channel
closed stops its run if one was going (as an interrupt would: the state stays), then
reads the address file until it names a kernel it has not tried, connects with the key
(which the kernel must prove too), and greets it again: hello, ready, and rank 0's
names. A rank on a node with a relay connects through it again, once the relay has
connected to the new kernel (``_rank.relay``). When the grace period passes with no
kernel, the rank ends (and so the job).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._wire.channel import ChannelClient
from .._wire.dataplane import Packed
from .._wire.messages import DebugInput
from .._wire.rundir import RELAY_ENV, RunDir
from .link import KernelLink, channel_to, relay_channel, to_node_relay

ADDRESS_POLL = 0.5
"""Seconds between two reads of the address file while no kernel is attached."""
SETTLE_WAIT = 30.0
"""How long the run in progress when the kernel went may take to stop after its
interrupt; a rank still in it then (stuck in a collective) ends, as no kernel could use
it."""


class AttachableLink(KernelLink):
    """A link to the session's kernel of the moment (see the module's docstring)."""

    def __init__(self, rank: int, channel: ChannelClient, run_dir: RunDir, address: str,
                 grace: float | None) -> None:
        super().__init__(rank, channel, None, run_dir)
        self._served = address  # the kernel's address this rank has been connected to
        self._grace = grace
        self.greeting: Callable[[], list[Any]] = list
        """What this rank says to a kernel that attaches (set by the worker as it goes)."""

    @classmethod
    def connect(cls, run_dir: RunDir, rank: int, grace: float | None) -> AttachableLink:
        """Connect to the kernel named in the session's folder (through the node's relay,
        if it has one), and listen to it."""
        address = run_dir.address.read_text()
        channel = to_node_relay(run_dir) or channel_to(address, run_dir)
        link = cls(rank, channel, run_dir, address, grace)
        link._listen_in_background()
        return link

    def send(self, message: Any, data: Packed | None = None) -> None:
        """Send to the kernel of the moment; with none attached, the message is lost (a
        run's output or report while its kernel is gone: nobody reads it)."""
        with contextlib.suppress(OSError):
            super().send(message, data)

    def _listen(self) -> None:
        while True:
            self._serve_channel()
            if self._grace == 0:
                self._kernel_gone()
                return
            self._settle()
            channel = self._next_kernel()
            if channel is None:
                print("nbddp: no kernel attached within the grace period; this rank ends",
                      file=sys.stderr)
                self._run_dir.remove()  # the key and the address: nobody may attach now
                self._starts.put(None)
                self._start_came.set()
                return
            with self._lock:
                gone, self._channel = self._channel, channel
            if gone is not None:
                gone.close()
            for message in self.greeting():
                self.send(message)

    def _settle(self) -> None:
        """The kernel went: no Start it sent is run from now on; interrupt the run this
        rank is in, if any (its report is lost, its state kept), and wait until the rank
        is back at rest (or end it, if it cannot come back: ``SETTLE_WAIT``)."""
        with self._lock:
            self._generation += 1
            busy = self.busy.is_set()
            self._interrupt_for = None  # (the SIGINT below is for the run it is in)
        if busy:
            print("nbddp: the notebook kernel went away; interrupting this run",
                  file=sys.stderr)
            os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + SETTLE_WAIT
        while self.busy.is_set():
            if self.asking.is_set() and self._answers.empty():  # pdb: nobody to answer
                self._answers.put(DebugInput(None, "the notebook kernel went away"))
            if time.monotonic() > deadline:
                print(f"nbddp: the run the kernel left did not stop within {SETTLE_WAIT:g} s; "
                      "this rank ends", file=sys.stderr)
                os._exit(1)
            time.sleep(0.05)

    def _next_kernel(self) -> ChannelClient | None:
        """Wait for a kernel at another address than the one that went, within the grace
        period: through the node's relay where it has one (which connects to the new
        kernel first), else straight to it."""
        deadline = None if self._grace is None else time.monotonic() + self._grace
        run_dir = self._run_dir
        relay = os.environ.get(RELAY_ENV)
        if relay:  # the relay listens once it reached a new kernel
            found = next_kernel(run_dir, None, deadline,
                                lambda _: relay_channel(Path(relay), run_dir), quiet=True)
        else:
            found = next_kernel(run_dir, self._served, deadline,
                                lambda address: channel_to(address, run_dir))
        if found is None:
            return None
        channel, self._served = found
        return channel


def next_kernel(run_dir: RunDir, served: str | None, deadline: float | None,
                connect: Callable[[str], ChannelClient],
                stopped: Callable[[], bool] = lambda: False, quiet: bool = False
                ) -> tuple[ChannelClient, str] | None:
    """Read the session's address file until it names a kernel other than ``served``
    that ``connect`` reaches (one that cannot be reached yet is tried again; ``quiet``:
    without saying so), before ``deadline`` (``time.monotonic()``; None: no end) and
    until ``stopped()``. The channel, and the address."""
    said = None
    while (deadline is None or time.monotonic() < deadline) and not stopped():
        time.sleep(ADDRESS_POLL)
        try:
            address = run_dir.address.read_text()
        except OSError:
            continue  # (the last kernel removed it as it went)
        if address == served:
            continue
        try:
            return connect(address), address
        except (OSError, ValueError, ConnectionError) as exc:
            if said != address and not quiet:
                said = address
                print(f"nbddp: cannot attach to the kernel at {address.strip()} yet: "
                      f"{exc}", file=sys.stderr)
    return None

