"""A session rank's link to the kernel and its interrupts, over a real channel in this
process: the kernel's side is a real ``ChannelServer``, the rank's a real ``KernelLink``
whose interrupts arrive as real SIGINTs.

The order that matters is a race in a session: rank 1 fails, so the kernel interrupts
rank 0, which has just finished the same run; the interrupt reaches it after its report,
with the next cell's Start right behind. The signal mask holds the SIGINT back until that
Start is queued, which makes the race happen every time.
"""

from __future__ import annotations

import contextlib
import queue
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from nbddp._rank.link import KernelLink
from nbddp._rank.loop import Interrupts
from nbddp._wire.channel import ChannelServer
from nbddp._wire.handshake import new_key
from nbddp._wire.messages import Hello, Interrupt, RankOptions, Start
from nbddp._wire.rundir import RunDir

from .conftest import wait_until

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """SIGINT pends instead of being delivered, in this thread and the threads it starts."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class Rank:
    """Rank 0's side: its link to a real kernel channel, and its interrupt handling,
    which counts the SIGINTs it is given."""

    def __init__(self, run_dir: RunDir) -> None:
        with sigint_held():  # (the link's listening thread keeps it held for good)
            self.link = KernelLink.local(run_dir, 0)
        self.sigints = 0
        self.interrupts = Interrupts(self._in_run)

    def _in_run(self) -> bool:
        self.sigints += 1
        return self.link.in_run()

    def take_start(self) -> None:
        """Wait for the next Start, as the worker does, and take it up: an interrupt
        kept while it waited is raised here."""
        assert self.link.wait_start() is not None
        with self.interrupts.armed():
            self.interrupts.raise_kept()

    def end_run(self) -> None:
        """The run's report is sent: the rank is at rest (what the worker does)."""
        self.link.run_over()
        self.interrupts.forget()


@pytest.fixture
def kernel_and_rank(tmp_path) -> Iterator[tuple[ChannelServer, Rank]]:
    """A kernel's channel server and rank 0 connected to it; SIGINT's handler restored
    afterwards."""
    run_dir = RunDir(tmp_path)
    key = new_key()
    run_dir.write_private(run_dir.key, key)
    heard: queue.SimpleQueue[Any] = queue.SimpleQueue()
    server = ChannelServer(run_dir.socket, key, heard.put)
    before = signal.getsignal(signal.SIGINT)
    rank = Rank(run_dir)
    try:
        rank.link.send(Hello(0, 0))
        assert isinstance(heard.get(timeout=5).message, Hello)  # (the server sends to it now)
        yield server, rank
    finally:
        rank.link.run_over()  # (a busy rank whose kernel goes ends its process)
        rank.link.close()
        server.close()
        signal.signal(signal.SIGINT, before)


def start() -> Start:
    return Start("0", "/records", "/payload", RankOptions(backend="gloo"), session=True)


def queued(link: KernelLink) -> bool:
    return not link._starts.empty()


def test_an_interrupt_for_a_run_already_over_is_not_raised_in_the_next(kernel_and_rank):
    server, rank = kernel_and_rank
    server.send(0, start())
    rank.take_start()
    rank.end_run()  # rank 0 is done; rank 1 failed, so the kernel interrupts rank 0 ...
    with sigint_held():
        server.send(0, Interrupt())
        server.send(0, start())  # ... and the next cell starts at once
        wait_until(lambda: queued(rank.link), timeout=5)
    wait_until(lambda: rank.sigints == 1, timeout=5)  # the SIGINT came, held till now
    try:
        rank.take_start()
    except KeyboardInterrupt:  # (pytest would end the whole session on it)
        pytest.fail("the interrupt meant for the run before stopped the next cell")


def test_an_interrupt_for_the_run_in_progress_is_raised_in_it(kernel_and_rank):
    server, rank = kernel_and_rank
    for _ in range(2):  # (the second run: after one that ended)
        server.send(0, start())
        rank.take_start()
        with pytest.raises(KeyboardInterrupt), rank.interrupts.armed():
            server.send(0, Interrupt())
            wait_until(lambda: False, timeout=5)
        rank.end_run()


def test_an_interrupt_for_a_run_not_yet_taken_up_is_raised_as_it_starts(kernel_and_rank):
    server, rank = kernel_and_rank
    server.send(0, start())
    rank.take_start()
    rank.end_run()
    server.send(0, start())
    server.send(0, Interrupt())  # behind its Start, before the rank takes it up
    wait_until(lambda: rank.sigints == 1, timeout=5)
    with pytest.raises(KeyboardInterrupt):
        rank.take_start()
