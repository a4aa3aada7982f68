"""A local rank group: torchrun on this machine, started before its run is known."""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._run.group import Launcher, LauncherExited, RankGroup, RanksGone
from .._run.records import Records
from .._run.shape import GroupShape, Handover
from .._wire import dataplane
from .._wire.channel import ChannelServer, new_key
from .._wire.dataplane import PAYLOAD_ROOM, RESULT_ROOM, Packed, Room
from .._wire.messages import (
    Disconnected,
    Failure,
    Hello,
    Present,
    RankOptions,
    Ready,
    RollCall,
    Sequenced,
    Start,
)
from .._wire.rundir import RunDir
from .._wire.stacks import STACKS_SIGNAL, STACKS_WAIT, main_thread_id, read_dump, render, size_of
from .launcher import LocalLauncher, stopping

ROLL_CALL_WAIT = 3.0
"""How long a waiting rank may take to answer its roll call. An idle rank answers within
a millisecond; one that has not answered by then is taken for stuck, and its group for
unfit to run."""


_LOCAL_GROUPS: set[LocalGroup] = set()
_LOCAL_GROUPS_LOCK = threading.Lock()


@atexit.register
def _end_local_groups() -> None:
    """At the kernel's exit, no group outlives it: not one still being seen off after
    its run, not a standby one (their run dirs would stay on disk)."""
    with _LOCAL_GROUPS_LOCK:
        groups = list(_LOCAL_GROUPS)
    for group in groups:
        group.stop()
        group.close()


class LocalGroup(RankGroup):
    """torchrun on this machine, started now for ``shape``; its ranks wait for Start."""

    ends_after_result = True  # its lifeline and PIDs stop it, even if the kernel dies

    def __init__(self, shape: GroupShape) -> None:
        super().__init__(shape.nprocs, RunDir.create())
        with _LOCAL_GROUPS_LOCK:
            _LOCAL_GROUPS.add(self)
        self.shape = shape
        self._pids: dict[int, int] = {}  # rank -> PID, for those that said hello
        self.ready: set[int] = set()
        self.broken = False
        """A rank or torchrun ended before the group was handed a run."""
        self.on_change: Callable[[LocalGroup], None] | None = None
        self._start: Start | None = None
        self._lock = threading.Lock()
        self._settled = threading.Event()  # every rank is ready, or the group broke
        self._gone: str | None = None
        """Why the group can no longer run anything: a rank or torchrun stopped."""
        self._calls = 0  # roll calls so far: the number of the latest
        self._present: set[int] = set()  # who answered the latest
        self._answered = threading.Condition(self._lock)
        self._payload_file: Path | None = None
        self._rooms: dict[str, Room] = {}
        self._rooms_closed = False
        self._stopped = False
        try:
            key = new_key()
            self.run_dir.write_private(self.run_dir.key, key)
            self._server = ChannelServer(self.run_dir.socket, key, self._deliver)
            self._torchrun = LocalLauncher(self.run_dir, shape)
            self._follow_launcher(self._torchrun)
        except BaseException:
            self.stop()
            self.close()
            raise

    @property
    def is_ready(self) -> bool:
        """Every rank waits for its Start."""
        return len(self.ready) == self.nprocs and not self.broken

    @property
    def handed_over(self) -> bool:
        return self._start is not None

    def wait_ready(self, timeout: float) -> bool:
        """Block until every rank waits for its Start; False if the group broke first
        or ``timeout`` passed."""
        self._settled.wait(timeout)
        return self.is_ready

    def launcher_tail(self, lines: int = 30) -> str:
        """The end of torchrun's output (why a group broke)."""
        try:
            text = self.run_dir.launcher_log.read_text(errors="replace")
        except OSError:
            return "(nothing)"
        return "\n".join(text.splitlines()[-lines:])

    def pids(self) -> list[int]:
        """torchrun's and the live ranks' process ids."""
        return self._torchrun.pids()

    def rank_pids(self) -> dict[int, int]:
        """Each rank's process id (once it has said hello)."""
        with self._lock:
            return dict(self._pids)

    def _deliver(self, message: Any) -> None:
        """Keep track of the ranks (the channel's threads call this), then queue it."""
        inner = message.message if isinstance(message, Sequenced) else message
        with self._lock:
            if isinstance(inner, Present):  # the hand-over's business, not the run's
                if inner.call == self._calls:
                    self._present.add(inner.rank)
                    self._answered.notify_all()
                return
            if isinstance(inner, Disconnected):
                self._lose(f"rank {inner.rank} had stopped")
            if isinstance(inner, Hello):
                self._torchrun.add_rank(inner.pid)
                self._pids[inner.rank] = inner.pid
                if self._start is not None and self._server is not None:
                    self._server.send(inner.rank, self._start)
            elif isinstance(inner, Ready):
                self.ready.add(inner.rank)
            elif isinstance(inner, (Failure, Disconnected)) and self._start is None:
                self.broken = True
        self.events.put(message)
        self._changed()

    def _wait_launcher(self, launcher: Launcher) -> None:
        code = launcher.wait()
        with self._lock:
            self.broken = self.broken or self._start is None
            self._lose("torchrun had stopped")
        self.events.put(LauncherExited(code))
        self._changed()

    def _lose(self, why: str) -> None:
        """(Under the lock) The group lost a process: it can take no run from now on."""
        self._gone = self._gone or why
        self._answered.notify_all()

    def _changed(self) -> None:
        if self.is_ready or self.broken:
            self._settled.set()
        notify = self.on_change
        if notify is not None:
            notify(self)

    def hand_over(self, payload: Packed, records: Records, options: RankOptions,
                  handover: Handover) -> None:
        """Call the roll of the ranks that wait for their Start, write the payload (into
        shared memory if it fits) while they answer, then send every rank its Start (a
        rank that has not said hello yet gets it when it does). Raises ``RanksGone``, and
        sends no Start, if the waiting ranks are not all there. A session's group is
        handed one run after another: each replaces the last one's payload."""
        called = self._roll_call()
        if self._payload_file is not None:
            self._payload_file.unlink(missing_ok=True)
        size = dataplane.size_of(payload)
        room = self._take_room(size)
        folder = dataplane.place(size, self.run_dir.path, self.run_dir.twin) \
            if room is None else room.parent
        self._payload_file = folder / self.run_dir.payload.name
        dataplane.write(self._payload_file, payload, room)
        start = self._start_message(self._payload_file, records, options, handover)
        with self._lock:
            self._await_answers(called)
            self.records = records
            self._start = start
            assert self._server is not None
            for rank in self._pids:
                self._server.send(rank, start)

    def _roll_call(self) -> set[int]:
        """Ask the ranks that wait for their Start to answer (at once, from the rank's
        listening thread); those ranks. A rank still starting is not asked: like a cold
        launch's ranks, it gets its Start when it is up. Raises ``RanksGone`` if a
        process of a group already up has stopped (a cold group's early end is the
        run's to tell, with torchrun's output)."""
        with self._lock:
            called = {rank for rank in self.ready if rank in self._pids}
            self._calls += 1
            self._present = set()
            assert self._server is not None
            for rank in sorted(called):
                if not self._server.send(rank, RollCall(self._calls)):
                    self._lose(f"rank {rank} had stopped")
            if self._pids and self._gone is not None:
                raise RanksGone(self._gone)
        return called

    def _await_answers(self, called: set[int]) -> None:
        """(Under the lock) Wait until every rank ``called`` has answered; RanksGone if
        the group lost a process, or a rank stays silent for ``ROLL_CALL_WAIT`` s."""
        if not called:
            return
        every = self._answered.wait_for(
            lambda: self._gone is not None or called <= self._present, ROLL_CALL_WAIT)
        if self._gone is not None:
            raise RanksGone(self._gone)
        if not every:
            silent = ", ".join(str(rank) for rank in sorted(called - self._present))
            raise RanksGone(f"rank {silent} did not answer within {ROLL_CALL_WAIT:g} s")
        if stopping(self._torchrun.process.pid):  # killed: the ranks die of it next
            raise RanksGone("torchrun had stopped")
        for rank in sorted(called):
            if stopping(self._pids[rank]):  # killed since it answered
                raise RanksGone(f"rank {rank} had stopped")

    def make_room(self, payload: int, result: int = 0) -> None:
        """Allocate shared memory in the background for the next payload and result
        (about the last ones' sizes), so that each is one copy into ready pages."""
        self._discard_rooms()
        twin = self.run_dir.twin
        if twin is None:
            return
        with self._lock:  # a group being closed makes none: nothing would remove them
            if not self._rooms_closed:
                self._rooms = {name: Room(twin / name, nbytes) for name, nbytes in
                               ((PAYLOAD_ROOM, payload), (RESULT_ROOM, result))
                               if nbytes >= Room.MIN}

    def _discard_rooms(self) -> None:
        with self._lock:
            rooms, self._rooms = self._rooms, {}
        for room in rooms.values():
            room.discard()

    def _take_room(self, size: int) -> Path | None:
        """The payload's room allocated ahead, if the payload (``size`` bytes) can go
        there."""
        with self._lock:
            room = self._rooms.pop(PAYLOAD_ROOM, None)
        if room is None or self.run_dir.twin is None or (path := room.take()) is None:
            return None
        have = path.stat().st_size
        if size > have and not dataplane.fits(size - have, self.run_dir.twin):
            path.unlink(missing_ok=True)
            return None
        return path

    def stacks(self, wait: float = STACKS_WAIT) -> dict[int, str]:
        """Every live rank's Python stacks (all threads, the main one first), taken
        without stopping it; a rank that does not answer within ``wait`` s is left out."""
        pids = self.rank_pids()
        files = {rank: self.run_dir.stacks_file(rank) for rank in pids}
        sizes = {rank: size_of(path) for rank, path in files.items()}
        answering = self._torchrun.signal_ranks(pids.values(), STACKS_SIGNAL)
        stacks = {}
        for rank, path in sorted(files.items()):
            dump = read_dump(path, sizes[rank], wait) if pids[rank] in answering else None
            if dump is not None:
                stacks[rank] = render(dump, main_thread_id(path))
        return stacks

    def interrupt(self, ranks: set[int]) -> None:
        self._torchrun.interrupt([self._pids[r] for r in ranks if r in self._pids])

    def stop(self, clean: bool = False) -> None:
        self.on_change = None
        super().stop(clean)
        self._stopped = True
        self._forget_when_done()

    def retire(self) -> None:
        """Close first: nothing needs the channel or the run dir once every rank has
        returned, and a kernel killed while torchrun exits must leave neither behind."""
        self.close()
        self.stop(clean=True)

    def close(self) -> None:
        with self._lock:
            self._rooms_closed = True
        self._discard_rooms()
        super().close()
        self._forget_when_done()

    def _forget_when_done(self) -> None:
        """Stopped and closed: nothing is left for the exit hook to end."""
        if self._stopped and self._closed:
            with _LOCAL_GROUPS_LOCK:
                _LOCAL_GROUPS.discard(self)
