"""Ranks that wait on the kernel's channel: started before their run, handed one or more.

A waiting group's ranks connect to the kernel's channel, say hello, prepare (import
torch, join a gloo group) and say they are ready; then they wait for their ``Start``.
This is what standby ranks and a session's ranks are, on this machine (``_local``) or on
a cluster's nodes (``_slurm.session``): the backend starts the ranks and says how the
payload reaches them, how a rank is interrupted, and how a dead process is seen.

Any of a waiting group's processes may die while idle. Before the Start, the ranks that
wait for it answer a roll call; a group that lost one is not handed the run
(``RanksGone``: the caller stops it and starts fresh ranks). Where the kernel sees the
ranks' processes (``sees_processes``: they run on this machine) a group that has run
before is not called: a process that died closed its connection, or is gone from (or
dying in) ``/proc``, which the hand-over checks in a tenth of a round trip's time. (A
rank stopped by SIGSTOP is not caught there: its run stalls, and the stall note or the
timeout says where each rank is.) Nor is a cluster group whose every rank's link was
heard in the last ``HEARD_LATELY`` seconds (the end of the cell before, at once): a
roll call would say no more, and costs a round trip to every node.

The group's parts of one idea each live beside it: the roll calls (``_run.groups.roll_calls``),
the Results held back to wake the kernel once (``_run.groups.held_results``), and where the
payload goes (``_run.groups.payload_place``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..._wire import dataplane
from ..._wire.dataplane import Packed
from ..._wire.messages import (
    Disconnected,
    Failure,
    Hello,
    RankOptions,
    Ready,
    Sequenced,
    SnapshotTaken,
    Start,
)
from ..._wire.rundir import RunDir
from ..._wire.shipped_code import RanksCode
from ..._wire.versions import skew
from ..records import Records
from .group import Launcher, LauncherExited, RankGroup, RanksGone
from .held_results import HeldResults
from .payload_place import PayloadPlace
from .roll_calls import RollCalls, heard_lately
from .shape import GroupShape, Handover


class WaitingGroup(RankGroup):
    """Ranks of ``shape`` that connect to this group's channel and wait for their Start.

    A backend sets ``_server`` (the channel) and follows its launcher
    (``_follow_launcher``); it may say where the payload goes (``_place_payload``), how
    to check the ranks that answered the roll call (``_check_present``), and how a rank
    is interrupted (``interrupt``)."""

    def __init__(self, shape: GroupShape, run_dir: RunDir) -> None:
        super().__init__(shape.nprocs, run_dir)
        self.shape = shape
        self._hellos: dict[int, Hello] = {}  # the ranks that said hello: PID, node
        self.ready: set[int] = set()
        self.broken = False
        """A rank or the launcher ended before the group was handed a run."""
        self.refusal: str | None = None
        """Why the group runs nothing: a node's versions differ from the kernel's."""
        self.on_change: Callable[[Any], None] | None = None
        """Told of this group (the backend's own type) as its ranks connect, get ready or die."""
        self._start: Start | None = None
        self._lock = threading.Lock()
        self._settled = threading.Event()  # every rank is ready, or the group broke
        self._gone: str | None = None
        """Why the group can no longer run anything: a rank or the launcher stopped."""
        self._roll = RollCalls(self._lock)
        """The ranks' roll calls before a run (see ``hand_over``)."""
        self._payload = PayloadPlace()
        """The latest run's payload, inside its Start or in a file (``payload_place``)."""
        self.code = RanksCode()
        """The user's module files these ranks hold, where their nodes may not see the
        notebook's (``_wire.shipped_code``)."""
        self._stopped = False
        self._held = HeldResults(self.events)
        """A run's Results, held back until the other ranks report (``held_results``)."""
        self.snapshots_taken: queue.SimpleQueue[SnapshotTaken] = queue.SimpleQueue()
        """What the ranks said of their snapshots, at rest: read before the next run."""

    @property
    def is_ready(self) -> bool:
        """Every rank waits for its Start."""
        return len(self.ready) == self.nprocs and not self.broken

    @property
    def handed_over(self) -> bool:
        return self._start is not None

    @property
    def gone(self) -> str | None:
        """Why the group can run nothing more (a rank or the launcher stopped), if so."""
        return self._gone

    def wait_ready(self, timeout: float | None) -> bool:
        """Block until every rank waits for its Start; False if the group broke first
        or ``timeout`` passed."""
        self._settled.wait(timeout)
        return self.is_ready

    def rank_pids(self) -> dict[int, int]:
        """Each rank's process id (once it has said hello)."""
        with self._lock:
            return {rank: hello.pid for rank, hello in self._hellos.items()}

    def rank_nodes(self) -> dict[int, str]:
        """Each rank's node, as it named it (once it has said hello)."""
        with self._lock:
            return {rank: hello.node for rank, hello in self._hellos.items()}

    def _deliver(self, message: Any) -> None:
        """Keep track of the ranks (the channel's threads call this), then queue it."""
        inner = message.message if isinstance(message, Sequenced) else message
        with self._lock:
            if RollCalls.is_answer(inner):  # the hand-over's business
                self._roll.heard(inner)
                return
            if isinstance(inner, SnapshotTaken):
                self.snapshots_taken.put(inner)
                return
            if self._took(inner) or self._held.holds(message, inner):
                return
            if isinstance(inner, Disconnected):
                self._lose(f"rank {inner.rank} had stopped")
            refused = isinstance(inner, Hello) and not self._said_hello(inner)
            if isinstance(inner, Ready):
                self.ready.add(inner.rank)
            elif isinstance(inner, (Failure, Disconnected)) and self._start is None:
                self.broken = True
            if not refused:  # (a refused rank's hello is said by its Failure)
                self._held.put(message)
        self._changed()

    def release_held(self) -> None:
        """Put the Results held back (``_run.groups.held_results``) on the events: nothing else
        came for a while, or the run is being wound up."""
        self._put(None)

    def _put(self, message: Any) -> None:
        """Put ``message`` on the events (None: nothing), after the Results held back."""
        with self._lock:  # (so that no thread's message goes between)
            self._held.put(message)

    def _took(self, message: Any) -> bool:
        """(Under the lock) True if ``message`` is the backend's own business (an answer
        it waits for), not the run's."""
        return self._answers_question(message)

    def _said_hello(self, hello: Hello) -> bool:
        """(Under the lock) A rank is up: it gets the Start if the run is known, unless
        its machine's versions differ from the kernel's (False: it is refused)."""
        if self.launcher is not None:
            self.launcher.add_rank(hello.pid)
        skewed = skew(hello.node, hello.versions) if hello.versions else None
        if skewed is not None:
            self._refuse(hello.rank, skewed)
            return False
        self._hellos[hello.rank] = hello
        if self._start is not None and self._server is not None:
            self._send_start(hello.rank)
        return True

    def _refuse(self, rank: int, why: str) -> None:
        """(Under the lock) The group can run nothing (a node's versions differ): a run
        that waits fails, naming ``rank``; a session that starts says ``why``."""
        self.refusal = self.refusal or why
        self.broken = True
        self._lose(why)
        self._held.put(Failure(rank, "VersionMismatch", "nbddp", why, ""))

    def _wait_launcher(self, launcher: Launcher) -> None:
        code = launcher.wait()
        with self._lock:
            self.broken = self.broken or self._start is None
            self._lose(f"{self.launcher_name} had stopped")
        self._put(LauncherExited(code))
        self._changed()

    def _lose(self, why: str) -> None:
        """(Under the lock) The group lost a process: it can take no run from now on."""
        self._gone = self._gone or why
        self._roll.wake()

    def _changed(self) -> None:
        if self.is_ready or self.broken:
            self._settled.set()
        notify = self.on_change
        if notify is not None:
            notify(self)

    def hand_over(self, payload: Packed, records: Records, options: RankOptions,
                  handover: Handover) -> None:
        """Call the roll of the ranks that wait for their Start, place the payload while
        they answer, then send every rank its Start (a rank that has not said hello yet
        gets it when it does). Raises ``RanksGone``, and sends no Start, if the waiting
        ranks are not all there. A session's group is handed one run after another: each
        replaces the last one's payload."""
        # (a session's group, for its next run: seen to be there without a roll call)
        seen = self._start is not None and len(self._hellos) == self.nprocs and (
            self.sees_processes or heard_lately(self._server, list(self._hellos)))
        called = set(self._hellos) if seen else self._roll_call()
        start = self._prepare_start(payload, records, options, handover)
        with self._lock:
            if seen:
                self._check_still_present(called)
            else:
                self._roll.wait(called, lambda: self._gone, self._check_present)
            self.records = records
            self._start = start
            self._held.expect(self.nprocs)
            self._send_starts(list(self._hellos))

    sees_processes = False
    """The kernel sees whether the ranks' processes live (they run on this machine)."""

    def _check_still_present(self, ranks: set[int]) -> None:
        """(Under the lock) Raise ``RanksGone`` if a process has stopped, as far as the
        kernel sees (a closed connection, ``/proc``)."""
        if self._gone is not None:
            raise RanksGone(self._gone)
        self._check_present(ranks)

    def _prepare_start(self, payload: Packed, records: Records, options: RankOptions,
                       handover: Handover) -> Start:
        """The run's Start, its payload placed where the ranks read it: inside the Start
        if it is small and holds no tensor or array data (no file to write and map: a
        session's quick cells), else in a data file (``_place_payload``)."""
        start = self._start_message(self.run_dir.payload, records, options, handover)
        return self._payload.start_for(start, payload, self._place_payload)

    def _send_start(self, rank: int) -> None:
        """(Under the lock, once the run is known) Send ``rank`` its Start."""
        assert self._server is not None and self._start is not None
        self._server.send(rank, self._start)

    def _send_starts(self, ranks: list[int]) -> None:
        """(Under the lock) Send each of ``ranks`` its Start: one message per node whose
        relay speaks for its ranks. (A rank not reached has gone: its connection's end
        says so.)"""
        assert self._server is not None and self._start is not None
        self._server.send_to_each(ranks, self._start)

    def payload_taken(self) -> None:
        """Every rank has taken the latest run's payload (they are back at rest): the
        kept copies of tensors it names need not stay open for them."""
        self._payload.taken()

    def make_room(self, payload: int, result: int = 0) -> None:
        """Get ready for a next payload and result of about these sizes (where the backend
        can allocate ahead: ``LocalGroup``)."""

    def _place_payload(self, payload: Packed) -> Path:
        """Write the payload where the ranks read it; its file (one a kernel that was
        attached to these ranks before left is replaced)."""
        self.run_dir.payload.unlink(missing_ok=True)
        dataplane.write(self.run_dir.payload, payload)
        return self.run_dir.payload

    def _roll_call(self) -> set[int]:
        """Ask the ranks that wait for their Start to answer; those ranks (one still
        starting gets its Start when it is up). ``RanksGone`` if a process of a group
        already up has stopped (a cold group's early end is the run's to tell)."""
        with self._lock:
            called = {rank for rank in self.ready if rank in self._hellos}
            assert self._server is not None
            missed = self._roll.call(self._server, called)
            if missed:
                self._lose(f"rank {min(missed)} had stopped")
            if self._hellos and self._gone is not None:
                raise RanksGone(self._gone)
        return called

    def stop(self, clean: bool = False) -> None:
        self.on_change = None
        super().stop(clean)
        self._stopped = True
        self._forget_if_done()

    def close(self) -> None:
        super().close()
        self._payload.taken()
        self._forget_if_done()

    def _forget_if_done(self) -> None:
        if self._stopped and self._closed:
            self._forget()

    def _forget(self) -> None:
        """Stopped and closed: the backend's exit hook has nothing left to end here."""

    def _check_present(self, called: set[int]) -> None:
        """(Under the lock) Every rank ``called`` answered: raise ``RanksGone`` if one of
        the group's processes was nonetheless killed since (where the kernel can see)."""
