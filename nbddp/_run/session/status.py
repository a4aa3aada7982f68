"""What ``%ddp_session`` (``Session.status()``) says: the ranks, their PIDs and memory,
where they run, the session's age and modes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SessionStatus:
    """What a session is running: its ranks, their PIDs and memory, its age."""

    open: bool
    nprocs: int
    backend: str
    uptime: float
    """Seconds since the current ranks started."""
    runs: int
    """Runs (cells) the session has run."""
    restarts: int
    """Times its ranks were replaced by fresh ones (state lost)."""
    pids: dict[int, int]
    """Each rank's process id."""
    rss_mib: dict[int, float]
    """Each rank's resident memory, in MiB (ranks on this machine)."""
    where: str = ""
    """Where the ranks run when not on this machine, e.g. ``SLURM job 12 on n[1-2]``."""
    hosts: dict[int, str] = dataclasses.field(default_factory=dict)
    """Each rank's machine (as its last run reported it, for ranks on a cluster)."""
    auto: bool = False
    """Auto mode: every cell runs on the ranks (``%ddp_session auto on``)."""
    autoreload: bool = False
    """The ranks reload the user's edited modules before each run."""
    snapshots: str = "snapshots off"
    """Whether the ranks' names are kept for fresh ranks, and the last snapshot's cell and
    size on each rank."""

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def __str__(self) -> str:
        if not self.open:
            return "nbddp session: closed"
        minutes, seconds = divmod(int(self.uptime), 60)
        hours, minutes = divmod(minutes, 60)
        on = f" on {self.where}" if self.where else ""
        lines = [f"nbddp session: {self.nprocs} ranks ({self.backend}){on}, up "
                 f"{hours}:{minutes:02d}:{seconds:02d}, {self.runs} runs, "
                 f"{self.restarts} restarts; auto mode {'on' if self.auto else 'off'}, "
                 f"autoreload {'on' if self.autoreload else 'off'}; {self.snapshots}"]
        for rank in range(self.nprocs):
            pid, rss, host = self.pids.get(rank), self.rss_mib.get(rank), self.hosts.get(rank)
            lines.append(f"  rank {rank}: pid {pid if pid else '(starting)'}"
                         + (f" on {host}" if host else "")
                         + (f", {rss:.0f} MiB resident" if rss is not None else ""))
        return "\n".join(lines)


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None
