"""Start torchrun for a local rank group, and stop every process of it by PID.

torchrun starts each rank in a session of its own, so stopping a group means signalling
torchrun's process group and each rank's PID (learned when the rank says hello). A PID
is only signalled while it still belongs to the process that connected, so a recycled
PID is never hit. The kernel holds a pipe (the lifeline) whose closing, when the kernel
dies, makes torchrun stop its ranks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Hashable, Iterable

from .._errors import NbddpError
from .._run.config import torchrun_environment
from .._run.groups.shape import GroupShape
from .._wire.rundir import LIFELINE_ABANDON, LIFELINE_GO, RunDir
from .cores import uses_relay

_PF_EXITING = 0x4  # a process's flags (/proc/PID/stat) while it exits
_SIGKILL = 1 << (signal.SIGKILL - 1)  # in a pending-signals mask
_PENDING = 31 - 3  # /proc/PID/stat's pending signals, counted from the state (field 3)
_TERM_GRACE = 0.5
_KILL_WAIT = 5.0
_CLEAN_EXIT_WAIT = 10.0  # every rank returned: torchrun exits by itself within this
def torchrun_command(run_dir: RunDir, shape: GroupShape, lifeline: int) -> list[str]:
    """The torchrun command line (run through ``nbddp._torchrun``) for one machine."""
    worker = ["-m", "nbddp._worker", str(run_dir.path)]
    if shape.prepare:
        worker += ["--prepare", shape.prepare]
    relay = ["--relay"] if uses_relay(shape.nprocs) else []
    return [
        shape.python, "-m", "nbddp._torchrun", str(run_dir.path), str(lifeline), *relay,
        "--standalone", "--nnodes", "1", "--nproc-per-node", str(shape.nprocs),
        "--max-restarts", str(shape.max_restarts), *worker,
    ]


class LocalLauncher:
    """The running torchrun process, and the means to stop it and its ranks.

    It starts before its run dir is made (``RunDir.reserve``), and waits until ``go``:
    a kernel that dies in between leaves nothing behind (see ``nbddp._torchrun``).
    """

    def __init__(self, run_dir: RunDir, shape: GroupShape) -> None:
        read_end, self._lifeline = os.pipe()
        try:
            self.process = subprocess.Popen(
                torchrun_command(run_dir, shape, read_end),
                env={**shape.env, **torchrun_environment(shape.max_restarts)},
                cwd=shape.cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, pass_fds=(read_end,), start_new_session=True,
            )
        except BaseException:
            os.close(self._lifeline)
            raise
        finally:
            os.close(read_end)
        self._run_dir = run_dir
        self._early: threading.Thread | None = None
        self._ranks: dict[int, str] = {}  # pid -> start time, to recognise the process
        self._stopping = threading.Lock()

    def go(self) -> None:
        """The run dir is made: torchrun starts. What it said before (a Python that
        cannot start it, say) is kept in the run dir's log, ahead of what follows."""
        try:
            os.write(self._lifeline, LIFELINE_GO)
        except BrokenPipeError:
            raise self._ended_before_go() from None
        assert self.process.stdout is not None  # (a pipe: see __init__)
        self._early = self._run_dir.keep_early_output(self.process.stdout)

    def _ended_before_go(self) -> BaseException:
        """What to raise when torchrun ended before it was told to start. A Ctrl-C can
        end it: Python starts a child with default signal handlers a moment before the
        child makes its own session, so a press at that instant reaches it too (as it
        reaches the kernel, whose hold then notes it): that is the interrupt."""
        code = self.process.wait()
        assert self.process.stdout is not None  # (a pipe, read by nobody yet)
        said = self.process.stdout.read().decode(errors="replace").strip()
        if code == -signal.SIGINT:
            return KeyboardInterrupt()
        return NbddpError(f"torchrun ended before it started (exit code {code})"
                          + (f"; it said:\n{said[-2000:]}" if said else ""))

    def abandon(self) -> None:
        """The run dir's name was taken: torchrun ends without removing anything."""
        with contextlib.suppress(OSError):
            os.write(self._lifeline, LIFELINE_ABANDON)
        self.stop()

    def add_rank(self, pid: int) -> None:
        start = _start_time(pid)
        if start is not None:
            self._ranks[pid] = start

    def stopped_from_outside(self) -> str | None:
        """A local run's ranks tell how they ended themselves (see ``diagnose``)."""
        return None

    def pids(self) -> list[int]:
        """torchrun's PID and the live ranks' PIDs."""
        return [self.process.pid, *self._alive_ranks()]

    def signal_ranks(self, pids: Iterable[int], sig: signal.Signals) -> set[int]:
        """``sig`` to those of ``pids`` that are this launcher's live ranks; those."""
        sent = set()
        for pid in set(pids) & set(self._alive_ranks()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                sent.add(pid)
        return sent

    def _alive_ranks(self) -> list[int]:
        return [pid for pid, start in list(self._ranks.items()) if _start_time(pid) == start]

    def _signal(self, sig: signal.Signals) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
        for pid in self._alive_ranks():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _wait_all(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None and not self._alive_ranks():
                return True
            time.sleep(0.01)
        return False

    def wait(self) -> int:
        """Block until torchrun exits; its exit code (its last words are in its log)."""
        code = self.process.wait()
        if self._early is not None:
            self._early.join(timeout=5)
        return code

    def stop(self, clean: bool = False) -> None:
        """SIGTERM torchrun and every rank, SIGKILL what is left after half a second.
        ``clean`` (every rank returned): first let torchrun exit by itself."""
        with self._stopping:
            if not (clean and self._wait_all(_CLEAN_EXIT_WAIT)):
                self._signal(signal.SIGTERM)
                if not self._wait_all(_TERM_GRACE):
                    self._signal(signal.SIGKILL)
                    self._wait_all(_KILL_WAIT)
            self.process.wait()
            if self._lifeline >= 0:  # torchrun is gone; nothing needs the pipe any more
                os.close(self._lifeline)
                self._lifeline = -1
            if self._early is None and self.process.stdout is not None:
                self.process.stdout.close()  # (never read: torchrun never started)


def _read_proc(pid: int, name: str) -> str:
    """``/proc/PID/NAME`` (a few hundred bytes), read in one system call, for a one-off
    look (``ProcessWatch`` keeps the files it looks at again and again open)."""
    fd = os.open(f"/proc/{pid}/{name}", os.O_RDONLY)
    try:
        return os.read(fd, 8192).decode(errors="replace")
    finally:
        os.close(fd)


def _fields(stat: str) -> list[str]:
    """A ``/proc/PID/stat``'s fields from the state (field 3) on: after the command name,
    which may itself hold spaces and parentheses."""
    return stat[stat.rindex(")") + 2:].split()


def _start_time(pid: int) -> str | None:
    """The start time of a live (not zombie) process, or None if there is none."""
    try:
        stat = _read_proc(pid, "stat")
    except OSError:
        return None
    fields = _fields(stat)
    return None if fields[0] in ("Z", "X") else fields[19]


def _stops(fields: list[str]) -> bool:
    """``ProcessWatch.stopping``, as far as the process's ``/proc/PID/stat`` ``fields``
    show: a SIGKILL sent to a process is set pending in each of its threads, which its
    ``signal`` field shows for the main one, until the process takes it; then it is
    exiting."""
    if fields[0] in ("Z", "X") or int(fields[6]) & _PF_EXITING:
        return True
    return bool(int(fields[_PENDING]) & _SIGKILL)


def _killed(status: str) -> bool:
    """A SIGKILL is pending for the whole process, as its ``/proc/PID/status`` shows."""
    for line in status.splitlines():
        if line.startswith("ShdPnd:"):
            return bool(int(line.split()[1], 16) & _SIGKILL)
    return False


class ProcessWatch:
    """Whether the processes a group looks at before every run still run code: each one
    followed under a name of the group's (``"torchrun"``, a rank) from the moment the
    group learns it (its start, a rank's hello), its ``/proc/PID/stat`` opened then and
    kept open: one ``pread`` per look, no path to resolve (a cold lookup in ``/proc``
    costs tens of microseconds). An open stat file stays the process's own: once it is
    reaped, reads fail, even if its PID is used again. So a PID reused within the group
    (a rank's new process given a dead one's PID) is never taken for the old process:
    what a name refers to changes only when the group follows a new process under it.

    A process that has just taken its SIGKILL shows it nowhere in ``stat`` for a few
    microseconds before it is marked exiting: its thread's pending signal is taken, and
    its state is running. So a running process's ``status`` is read as well, whose
    process-wide pending signals still hold the kill (a resting rank sleeps: one read)."""

    def __init__(self) -> None:
        self._files: dict[Hashable, tuple[int, int] | None] = {}
        """Each name's process: its open ``stat`` and ``status`` (None: gone when followed)."""
        self._closed = False

    def follow(self, name: Hashable, pid: int) -> None:
        """From now on ``name`` is the process ``pid`` (the one that holds it now)."""
        self._forget(name)
        if self._closed:
            return
        opened: list[int] = []
        try:
            for file in ("stat", "status"):
                opened.append(os.open(f"/proc/{pid}/{file}", os.O_RDONLY))
        except OSError:  # gone already
            for fd in opened:
                os.close(fd)
            self._files[name] = None
            return
        self._files[name] = (opened[0], opened[1])

    def stopping(self, name: Hashable) -> bool:
        """True if ``name``'s process is gone, a zombie, exiting, or killed a moment ago
        (SIGKILL pending): it runs no more code; also if no process was followed under
        ``name``. A process killed while others wait on it (torchrun's ranks die of its
        death, see ``_worker``) is seen before they can notice. Once the watch is closed:
        True, opening nothing (its group is closing)."""
        files = None if self._closed else self._files.get(name)
        if files is None:
            return True
        stat, status = files
        try:
            fields = _fields(os.pread(stat, 8192, 0).decode(errors="replace"))
            if _stops(fields):
                return True
            return fields[0] == "R" and _killed(os.pread(status, 8192, 0).decode(
                errors="replace"))
        except OSError:
            return True

    def _forget(self, name: Hashable) -> None:
        files = self._files.pop(name, None)
        for fd in files or ():
            os.close(fd)

    def close(self) -> None:
        self._closed = True
        for name in list(self._files):
            self._forget(name)
