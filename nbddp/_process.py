"""Start torchrun for a run, and stop every process of the run by PID.

torchrun starts each rank in a session of its own, so stopping a run means signalling
torchrun's process group and each rank's PID (learned when the rank connects). A PID is
only signalled while it still belongs to the process that connected, so a recycled PID
is never hit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ._config import RunConfig
from ._rundir import RunDir

_TERM_GRACE = 0.5
_KILL_WAIT = 5.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


def torchrun_command(run_dir: RunDir, config: RunConfig, lifeline: int) -> list[str]:
    """The torchrun command line (run through ``nbddp._torchrun``) for one machine."""
    return [
        sys.executable, "-m", "nbddp._torchrun", str(run_dir.path), str(lifeline),
        "--standalone", "--nnodes", "1", "--nproc-per-node", str(config.nprocs),
        "--max-restarts", "0",
        "-m", "nbddp._worker", str(run_dir.path), str(run_dir.records),
    ]


def rank_environment(config: RunConfig) -> dict[str, str]:
    """The kernel's environment, made right for ranks that are not a notebook."""
    env = dict(os.environ)
    if env.get("MPLBACKEND", "").startswith("module://matplotlib_inline"):
        del env["MPLBACKEND"]  # ipykernel's inline backend has no kernel in a rank
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + path if path else "")
    if config.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = config.cuda_visible_devices
    env.update(config.env)
    return env


class Launcher:
    """The running torchrun process, and the means to stop it and its ranks."""

    def __init__(self, run_dir: RunDir, config: RunConfig) -> None:
        read_end, self._lifeline = os.pipe()
        log = os.open(run_dir.launcher_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self.process = subprocess.Popen(
                torchrun_command(run_dir, config, read_end), env=rank_environment(config),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(read_end,), start_new_session=True,
            )
        finally:
            os.close(read_end)
            os.close(log)
        self._ranks: dict[int, str] = {}  # pid -> start time, to recognise the process

    def add_rank(self, pid: int) -> None:
        start = _start_time(pid)
        if start is not None:
            self._ranks[pid] = start

    def stopped_from_outside(self) -> str | None:
        """A local run's ranks tell how they ended themselves (see ``diagnose``)."""
        return None

    def _alive_ranks(self) -> list[int]:
        return [pid for pid, start in self._ranks.items() if _start_time(pid) == start]

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
        """Block until torchrun exits; its exit code."""
        return self.process.wait()

    def stop(self, clean: bool = False) -> None:
        """SIGTERM torchrun and every rank, SIGKILL what is left after half a second."""
        self._signal(signal.SIGTERM)
        if not self._wait_all(_TERM_GRACE):
            self._signal(signal.SIGKILL)
            self._wait_all(_KILL_WAIT)
        self.process.wait()
        self.release()

    def release(self) -> None:
        """Close the lifeline (torchrun stops itself if still running)."""
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1


def _start_time(pid: int) -> str | None:
    """The start time of a live (not zombie) process, or None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else fields[19]
