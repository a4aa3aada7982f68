"""A rank's link to the kernel: its messages out, its ``Start`` in.

A local rank talks over the kernel's Unix socket in both directions, and a session's rank
on a cluster node over the kernel's TCP channel; a closed connection means the kernel is
gone, and the rank stops. The kernel interrupts a session's rank with a message,
behind the run's Start; it asks a rank it cannot signal (on another node) for its
stacks, and any rank where it is in its collectives. It answers the kernel's roll
call (sent to waiting ranks before their ``Start``) at once, from the thread that
listens. A SLURM job's rank also writes every message to its mailbox file, reads its
``Start`` from the run folder, and carries on without the kernel: the job outlives a
kernel restart and can be re-attached. Messages are numbered, so the kernel keeps one
copy of what arrives both ways.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._wire.channel import ChannelClient
from .._wire.dataplane import Packed
from .._wire.frames import decode, split_frames
from .._wire.hang_messages import Collectives, ShowCollectives, ShowStacks, Stacks
from .._wire.mailbox import MailboxWriter, mailbox_path
from .._wire.messages import (
    DebugInput,
    DebugPrompt,
    Interrupt,
    KeepPayload,
    PayloadKept,
    Present,
    RollCall,
    Sequenced,
    Start,
)
from .._wire.rundir import NODE_DISK_ENV, NODE_SHM_ENV, RELAY_ENV, RunDir, parse_address
from .._wire.stacks import dump_now, main_thread_id
from .._wire.transfer import Inbox, Outgoing, copy_into, place_in
from . import setup_check
from .collectives import progress
from .restarts import requeue_count, restart_count

ATTEMPT = restart_count()
"""Which of torchrun's attempts this rank belongs to (0, or the restarts before it)."""
REQUEUE = requeue_count()
"""Which of SLURM's runs of the job this rank belongs to (0, or the requeues before it)."""


class KernelLink:
    """Where this rank's messages go (socket and/or mailbox), and where its Start comes from."""

    def __init__(self, rank: int, channel: ChannelClient | None, mailbox: MailboxWriter | None,
                 run_dir: RunDir) -> None:
        self.rank = rank
        self._channel, self._mailbox, self._run_dir = channel, mailbox, run_dir
        self._seq = 0
        self._lock = threading.Lock()
        self._starts: queue.SimpleQueue[tuple[int, int, Start] | None] = queue.SimpleQueue()
        self._start_came = threading.Event()  # (set as each is queued: see rests_for)
        self._received = 0  # Starts that came over the channel; each run's number
        self._running = -1  # the number of the run taken last (-1: none, or from a file)
        self._finished = -1  # ... and of the last run over
        self._interrupt_for: int | None = None
        """The run the kernel's last Interrupt was for (it comes behind that run's
        Start); None: a SIGINT is for whatever run the rank is in."""
        self._generation = 0
        """Which kernel this link serves (a SLURM session's rank may serve several, one
        after another): a Start from an earlier one is not run."""
        self._answers: queue.Queue[DebugInput] = queue.Queue()
        self.asking = threading.Event()
        """Set while pdb waits for the notebook's answer."""
        self.busy = threading.Event()
        """Set while the rank runs a Start: the kernel closing the link then means it
        is gone (the rank stops); at rest it means the rank is no longer wanted."""
        self._kept: Path | None = None  # the payload this node's ranks map (local rank 0)

    @classmethod
    def local(cls, run_dir: RunDir, rank: int) -> KernelLink:
        """Connect to the kernel (through the node's relay, if it has one); if it goes
        away while the rank is busy, stop the rank."""
        channel = to_node_relay(run_dir) or ChannelClient(run_dir.socket,
                                                          run_dir.key.read_bytes())
        link = cls(rank, channel, None, run_dir)
        link._listen_in_background()
        return link

    def _listen_in_background(self, listen: Callable[[], None] | None = None) -> None:
        threading.Thread(target=listen or self._listen, daemon=True,
                         name="nbddp-kernel-link").start()

    @classmethod
    def slurm(cls, run_dir: RunDir, rank: int) -> KernelLink:
        """The kernel's TCP channel if it can be reached, and the mailbox file always. The
        kernel asks over the channel (stacks, collectives); when it goes, the rank goes on
        (the job outlives the kernel) and writes to its mailbox alone."""
        link = cls(rank, _reach_kernel(run_dir),
                   MailboxWriter(mailbox_path(run_dir.path, rank)), run_dir)
        if link._channel is not None:
            link._listen_in_background(link._serve_channel)  # (not _listen: no exit)
        return link

    def send(self, message: Any, data: Packed | None = None) -> None:
        """Send ``message``; with ``data``, the data file it names goes along over the
        channel (a kernel on another machine: a result's tensors)."""
        with self._lock:
            outgoing = Outgoing(data) if data is not None and self._channel else None
            numbered = Sequenced(self._seq, message, ATTEMPT, REQUEUE)
            self._seq += 1
            if self._mailbox is not None:
                self._mailbox.send(numbered)
            if self._channel is not None:
                try:
                    self._channel.send(numbered, outgoing)
                except OSError:
                    if self._mailbox is None:
                        raise
                    self._channel = None  # the kernel went; the mailbox carries on

    def wait_start(self) -> Start | None:
        """Block until the kernel says what to run (a SLURM rank reads it from its file),
        and mark the rank busy; None once the kernel has closed the link."""
        if self._mailbox is not None:
            bodies, _ = split_frames(self._run_dir.start.read_bytes())
            self.busy.set()
            return decode(bodies[0])
        while (item := self._starts.get()) is not None:
            generation, number, start = item
            with self._lock:
                if generation == self._generation:
                    self._running = number
                    self.busy.set()
                    return start
        return None

    def rests_for(self, seconds: float) -> None:
        """Wait up to ``seconds`` unless a Start (or the link's end) comes first: the rank's
        work at rest waits while the kernel ends the run it just reported."""
        deadline = time.monotonic() + seconds
        self._start_came.clear()
        while self._starts.empty() and (left := deadline - time.monotonic()) > 0:
            self._start_came.wait(left)
            self._start_came.clear()

    def run_over(self) -> None:
        """The run taken last is over (its report sent): the rank is at rest, and an
        interrupt the kernel sent for that run, still on its way, is for no run now."""
        with self._lock:
            self._finished = self._running
            self.busy.clear()

    def in_run(self) -> bool:
        """The rank runs a Start, or has one waiting to be taken, and the kernel's last
        interrupt was not for a run already over: an interrupt now is for that run. (A
        rank that ended its run as the kernel interrupted it, the next Start already
        queued, would otherwise raise it in the next cell.)"""
        interrupt_for = self._interrupt_for  # (no lock: called by the signal handler,
        # in the main thread, which may hold it to send)
        stale = interrupt_for is not None and interrupt_for <= self._finished
        return not stale and (self.busy.is_set() or not self._starts.empty())

    def ask(self, prompt: DebugPrompt) -> DebugInput:
        """Send pdb's prompt to the kernel and wait for the user's line."""
        if self._mailbox is not None:
            return DebugInput(None, "a SLURM job's ranks cannot take input from the notebook")
        self.asking.set()
        try:
            self.send(prompt)
            return self._answers.get()
        finally:
            self.asking.clear()

    def _listen(self) -> None:
        self._serve_channel()
        self._kernel_gone()

    def _serve_channel(self) -> None:
        """Take the kernel's messages until the channel closes."""
        assert self._channel is not None
        try:
            while True:
                message = self._channel.receive()
                if isinstance(message, RollCall):  # answered here: the main thread may wait
                    with contextlib.suppress(OSError):  # (the next receive says why)
                        self.send(Present(self.rank, message.call))
                elif isinstance(message, Start):
                    self._received += 1
                    self._starts.put((self._generation, self._received, message))
                    self._start_came.set()
                    # (after: freeing a GiB takes a fifth of a second, not the run's)
                    self._drop_kept_unless(message.payload)
                elif isinstance(message, KeepPayload):
                    self._keep(message)
                elif isinstance(message, DebugInput):
                    self._answers.put(message)
                elif isinstance(message, Interrupt):  # raised in the main thread, if in a run
                    with self._lock:
                        self._interrupt_for = self._received
                    os.kill(os.getpid(), signal.SIGINT)
                elif isinstance(message, ShowStacks):  # (this thread must go on listening)
                    threading.Thread(target=self._send_stacks, args=(message.call,),
                                     daemon=True, name="nbddp-stacks").start()
                elif isinstance(message, ShowCollectives):
                    threading.Thread(target=self._send_collectives, args=(message.call,),
                                     daemon=True, name="nbddp-collectives").start()
        except (ConnectionError, EOFError, pickle.UnpicklingError):
            pass

    def _keep(self, message: KeepPayload) -> None:
        """Keep the next run's payload on this node, and tell the kernel where: the file
        that came with ``message``, or a copy of the session folder's. The last run's copy
        goes first (its ranks mapped it when their run started; the room is the next's)."""
        self._drop_kept_unless(message.file)
        file = message.file or (self._copy_to_node(message.copy_from) if message.copy_from
                                 else "")  # ("": the node had no room for the file)
        self._kept = Path(file) if file else None
        with contextlib.suppress(OSError):
            self.send(PayloadKept(self.rank, file))

    def _copy_to_node(self, shared: str) -> str:
        """A copy of the payload in the session's folder, in this node's inbox (``""``:
        no room for it; the node's ranks map the shared one)."""
        try:
            return str(copy_into(Path(shared), node_inbox(self._run_dir)))
        except OSError as exc:
            print(f"nbddp: no room on this node for the payload ({exc}); its ranks read "
                  "it from the session's folder", file=sys.stderr)
            return ""

    def _drop_kept_unless(self, payload: str) -> None:
        """Remove the payload this node kept for an earlier run, unless it is ``payload``."""
        if self._kept is not None and str(self._kept) != payload:
            self._kept.unlink(missing_ok=True)
            self._kept = None

    def _kernel_gone(self) -> None:
        """The kernel closed the channel: stop the rank if it is busy (nobody will read
        its report), or end its wait for a Start."""
        if self.busy.is_set():
            print("nbddp: the notebook kernel went away; stopping this rank", file=sys.stderr)
            os._exit(1)
        self._starts.put(None)
        self._start_came.set()

    def _send_stacks(self, call: int) -> None:
        """Dump every thread's stack from this thread (faulthandler, while the main
        thread may wait in a collective), whole, and send the dump back."""
        path = self._run_dir.stacks_file(self.rank)
        dump = dump_now(path)
        with contextlib.suppress(OSError):
            self.send(Stacks(self.rank, call, dump, main_thread_id(path)))

    def _send_collectives(self, call: int) -> None:
        """Say where this rank is in its collectives (torch's flight recorder, or the
        process groups' own counts)."""
        with contextlib.suppress(OSError):
            self.send(Collectives(self.rank, call, *progress(), setup=setup_check.look()))

    def close(self) -> None:
        for end in (self._channel, self._mailbox):
            if end is not None:
                end.close()
        if self._kept is not None:
            self._kept.unlink(missing_ok=True)


def node_inbox(run_dir: RunDir) -> Inbox:
    """Where data files from the kernel land on this node: its shared memory where they
    fit, else its local disk (else the run folder, where the wrapper made neither)."""
    shm, disk = os.environ.get(NODE_SHM_ENV), os.environ.get(NODE_DISK_ENV)
    return place_in(Path(shm) if shm else None, Path(disk) if disk else run_dir.path)


def to_node_relay(run_dir: RunDir) -> ChannelClient | None:
    """A connection to this node's relay, which speaks to the kernel for the node's ranks
    (``_rank.relay``), if the node has one (its data files cross the relay, not here)."""
    relay = os.environ.get(RELAY_ENV)
    return relay_channel(Path(relay), run_dir) if relay else None


def relay_channel(socket: Path, run_dir: RunDir) -> ChannelClient:
    """A connection to the node's relay listening at ``socket``, with the run's key."""
    return ChannelClient(socket, run_dir.key.read_bytes())


def channel_to(address: str, run_dir: RunDir) -> ChannelClient:
    """A connection to the kernel's TCP channel at ``address`` (the address file's text),
    with the run's key; data files the kernel sends land in this node's inbox."""
    return ChannelClient(parse_address(address), run_dir.key.read_bytes(),
                         node_inbox(run_dir))


def _reach_kernel(run_dir: RunDir) -> ChannelClient | None:
    """A SLURM rank's TCP connection to the kernel, or None if it cannot be reached."""
    try:
        return channel_to(run_dir.address.read_text(), run_dir)
    except (OSError, ValueError, ConnectionError) as exc:
        print(f"nbddp: cannot reach the notebook kernel ({exc}); reporting through files "
              f"in {run_dir.path}", file=sys.stderr)
        return None
