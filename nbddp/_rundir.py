"""The run's private directory (payload, key, channel socket), and its records' paths.

The directory is 0700 and every file in it 0600, so only the user who launched the
run can read the payload or reach the channel. A local run's directory is temporary and
removed when the run ends; its records (per-rank logs, metrics) live in a folder of
their own that is kept. A SLURM job's ranks run on other machines, so its run directory
is its records folder, on the shared filesystem; only the payload and key are removed.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

from ._records import new_records_dir

_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux
LOG_TAIL_BYTES = 64 * 2**20


class RunDir:
    """Paths of one run's files; a run dir made by ``create`` is private to the user."""

    def __init__(self, path: Path, records: Path | None = None, shared: bool = False) -> None:
        self.path = path
        self.records = records or path
        self.shared = shared
        """A SLURM job's run dir: it is the records folder, and outlives the run."""
        self.payload = path / "payload.pkl"
        self.key = path / "key"
        self.socket = path / "channel.sock"
        self.address = path / "channel.address"  # a SLURM job's: "host port" of the kernel
        self.job = path / "job.json"  # a SLURM job's id and shape, to re-attach
        self.launcher_log = self.records / "torchrun.log"
        self.metrics = self.records / "metrics.jsonl"

    @classmethod
    def create(cls) -> RunDir:
        path = Path(tempfile.mkdtemp(prefix="nbddp-"))  # mode 0700
        if len(str(path / "channel.sock")) > _MAX_SOCKET_PATH:
            path.rmdir()
            path = Path(tempfile.mkdtemp(prefix="nbddp-", dir="/tmp"))
        return cls(path, new_records_dir())

    @classmethod
    def create_shared(cls) -> RunDir:
        """A SLURM job's run dir: its records folder, which the ranks can reach."""
        return cls.of_job(new_records_dir())

    @classmethod
    def of_job(cls, path: Path) -> RunDir:
        """The run dir of a SLURM job, which is also its records folder."""
        return cls(path, path, shared=True)

    def failures_file(self) -> Path:
        """Where this torchrun (one per machine) records how its ranks ended."""
        return self.path / f"failures-{_this_torchrun()}.json"

    def torchrun_log_dir(self) -> Path:
        """This torchrun's own log dir (``--log-dir``), kept inside the run dir."""
        return self.path / f"torchelastic-{_this_torchrun()}"

    def failure_files(self) -> list[Path]:
        return sorted(self.path.glob("failures-*.json"))

    def rank_log(self, rank: int) -> Path:
        return self.records / f"rank-{rank}.log"

    def write_private(self, path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    def read_logs(self, nprocs: int) -> dict[int, str]:
        """Every rank's output (the last 64 MB of it), for errors and ``Job.logs``."""
        logs = {}
        for rank in range(nprocs):
            try:
                with open(self.rank_log(rank), "rb") as f:
                    f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_TAIL_BYTES))
                    logs[rank] = f.read().decode("utf-8", errors="replace")
            except FileNotFoundError:
                logs[rank] = ""
        return logs

    def remove(self) -> None:
        """Remove the run dir; a shared one (the records) keeps all but its secrets."""
        if self.shared:
            for secret in (self.payload, self.key, self.address):
                secret.unlink(missing_ok=True)
        else:
            shutil.rmtree(self.path, ignore_errors=True)


def _this_torchrun() -> str:
    """Names the files of one machine's torchrun apart from another's (SLURM's virtual
    nodes can share a host name, so the PID goes in too)."""
    return f"{socket.gethostname()}-{os.getpid()}"
