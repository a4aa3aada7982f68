"""A local rank group: torchrun on this machine, started before its run is known."""

from __future__ import annotations

import atexit
import threading
from pathlib import Path

from .._errors import NbddpError
from .._run.diagnosis.stack_view import render
from .._run.groups.group import RanksGone
from .._run.groups.shape import GroupShape
from .._run.groups.waiting import WaitingGroup
from .._wire import dataplane
from .._wire.channel import ChannelServer
from .._wire.dataplane import PAYLOAD_ROOM, RESULT_ROOM, Packed, Room
from .._wire.handshake import new_key
from .._wire.messages import Hello, Interrupt
from .._wire.rundir import RunDir
from .._wire.stacks import (
    STACKS_SIGNAL,
    STACKS_WAIT,
    main_is_whole,
    main_thread_id,
    read_dump,
    size_of,
)
from .launcher import LocalLauncher, ProcessWatch

TORCHRUN = "torchrun"
"""The name the hand-over's watch follows torchrun's process under (ranks: their number)."""
_LOCAL_GROUPS: set[LocalGroup] = set()
_LOCAL_GROUPS_LOCK = threading.Lock()


@atexit.register
def _end_local_groups() -> None:
    """At the kernel's exit, no group outlives it: not one still being seen off after
    its run, not a standby one (their run dirs would stay on disk)."""
    with _LOCAL_GROUPS_LOCK:
        groups = list(_LOCAL_GROUPS)
    for group in groups:  # all closed first: a kernel killed while it stops them (a
        group.close()  # front end's shutdown gives it seconds) leaves no folder behind
    for group in groups:
        group.retire(clean=False)


def _start_torchrun(shape: GroupShape) -> tuple[RunDir, LocalLauncher]:
    """A new run dir, made once its torchrun runs (and waits): a kernel that dies at any
    moment leaves it to torchrun to remove. A name someone took meanwhile (64 random
    bits: never, but for one who could read them) is given up for another."""
    for _ in range(3):
        run_dir = RunDir.reserve()
        launcher = LocalLauncher(run_dir, shape)
        try:
            run_dir.make()
        except FileExistsError:
            launcher.abandon()
            continue
        except BaseException:
            launcher.stop()
            raise
        return run_dir, launcher
    raise NbddpError("nbddp could not make a private run dir: each new name was taken")


class LocalGroup(WaitingGroup):
    """torchrun on this machine, started now for ``shape``; its ranks wait for Start.
    The payload goes into shared memory where it fits, into a room allocated ahead."""

    ends_after_result = True  # its lifeline and PIDs stop it, even if the kernel dies
    sees_processes = True  # its ranks are this machine's processes

    def __init__(self, shape: GroupShape) -> None:
        run_dir, self._torchrun = _start_torchrun(shape)
        super().__init__(shape, run_dir)
        with _LOCAL_GROUPS_LOCK:
            _LOCAL_GROUPS.add(self)
        self._rooms: dict[str, Room] = {}
        self._rooms_closed = False
        self._freeing: list[threading.Thread] = []  # rooms discarded, being freed
        self._watch = ProcessWatch()  # (under the lock: used by hand-overs, closed with us)
        try:
            self._watch.follow(TORCHRUN, self._torchrun.process.pid)
            key = new_key()
            self.run_dir.write_private(self.run_dir.key, key)
            self._server = ChannelServer(self.run_dir.socket, key, self._deliver)
            self._torchrun.go()
            self._follow_launcher(self._torchrun)
        except BaseException:
            self.stop()
            self.close()
            raise

    def pids(self) -> list[int]:
        """torchrun's and the live ranks' process ids."""
        return self._torchrun.pids()

    def _place_payload(self, payload: Packed) -> Path:
        """Into the room allocated ahead, else shared memory if it fits, else the run dir."""
        size = dataplane.size_of(payload)
        room = self._take_room(size)
        folder = dataplane.place(size, self.run_dir.path, self.run_dir.twin) \
            if room is None else room.parent
        path = folder / self.run_dir.payload.name
        dataplane.write(path, payload, room)
        return path

    def _said_hello(self, hello: Hello) -> bool:
        """(Under the lock) The hand-over watches the process that said hello for its
        rank (a PID the rank's earlier process had is not taken for it)."""
        self._watch.follow(hello.rank, hello.pid)
        return super()._said_hello(hello)

    def _check_present(self, called: set[int]) -> None:
        if self._watch.stopping(TORCHRUN):  # killed: the ranks die of it next
            raise RanksGone("torchrun had stopped")
        for rank in sorted(called):
            if self._watch.stopping(rank):  # killed since it answered
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

    def _discard_rooms(self, wait: bool = False) -> None:
        """Free the rooms made for the next run: in the background as a run ends (freeing
        a GiB of shared memory takes a fifth of a second, not the cell's to wait for);
        ``wait``: here, and those being freed too (the group stops)."""
        with self._lock:
            rooms, self._rooms = self._rooms, {}
            freeing = self._freeing = [thread for thread in self._freeing if thread.is_alive()]
        if wait:
            _discard(list(rooms.values()))
            for thread in freeing:
                thread.join()
        elif rooms:
            thread = threading.Thread(target=_discard, args=(list(rooms.values()),),
                                      daemon=True, name="nbddp-room-free")
            with self._lock:
                self._freeing.append(thread)
            thread.start()

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

    def stacks(self, wait: float = STACKS_WAIT, full: bool = False) -> dict[int, str]:
        """Every live rank's Python stacks (rendered by ``stack_view``), taken without
        stopping it; a rank that does not answer within ``wait`` s is left out. A dump
        without the main thread's whole block is taken again, once."""
        pids = self.rank_pids()
        mains = {rank: main_thread_id(self.run_dir.stacks_file(rank)) for rank in pids}
        dumps = self._dumps(pids, mains, wait)
        again = {rank: pids[rank] for rank, dump in dumps.items()
                 if dump is not None and not main_is_whole(dump, mains[rank])}
        if again:
            dumps.update({rank: dump for rank, dump in self._dumps(again, mains, wait).items()
                          if dump is not None and main_is_whole(dump, mains[rank])})
        return {rank: render(rank, dump, mains[rank], full)
                for rank, dump in sorted(dumps.items()) if dump is not None}

    def _dumps(self, pids: dict[int, int], mains: dict[int, str | None],
               wait: float) -> dict[int, str | None]:
        """Signal ``pids``' ranks to dump their stacks; each one's dump (None: none came)."""
        files = {rank: self.run_dir.stacks_file(rank) for rank in pids}
        sizes = {rank: size_of(path) for rank, path in files.items()}
        answering = self._torchrun.signal_ranks(pids.values(), STACKS_SIGNAL)
        return {rank: read_dump(path, sizes[rank], wait, mains[rank])
                if pids[rank] in answering else None for rank, path in files.items()}

    def interrupt(self, ranks: set[int]) -> None:
        """Ask each rank of ``ranks`` to raise ``KeyboardInterrupt`` in the user's code,
        over its channel, as a SLURM rank is asked: behind the run's Start, which a
        signal could overtake (a rank not yet holding its Start would drop the signal,
        then run the whole cell)."""
        assert self._server is not None
        for rank in sorted(ranks):
            self._server.send(rank, Interrupt())

    def retire(self, clean: bool = True) -> None:
        """Close first: nothing needs the channel or the run dir once every rank has
        returned (or of a group nobody will use), and a kernel killed while torchrun
        exits must leave neither behind. ``clean``: let torchrun end by itself first.
        Once every process is gone, the run dir is removed again: torchrun may still
        write its logs into it as it exits, and a folder that gains a file while it is
        being removed stays."""
        self.close()
        self.stop(clean)
        self.run_dir.remove()

    def stop(self, clean: bool = False) -> None:
        """Stop every process; the data files in shared memory go first (nothing reads
        them once the group stops), so that a kernel killed before ``close`` leaves
        none there: torchrun, which would remove them when the kernel dies, is gone."""
        self._close_rooms()
        self.run_dir.remove_twin()
        super().stop(clean)

    def close(self) -> None:
        with self._lock:
            self._watch.close()
        self._close_rooms()
        super().close()

    def _close_rooms(self) -> None:
        with self._lock:
            self._rooms_closed = True
        self._discard_rooms(wait=True)

    def _forget(self) -> None:
        with _LOCAL_GROUPS_LOCK:
            _LOCAL_GROUPS.discard(self)


def _discard(rooms: list[Room]) -> None:
    """Free ``rooms`` (each once its allocation has finished)."""
    for room in rooms:
        room.discard()
