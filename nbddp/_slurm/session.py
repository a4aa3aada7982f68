"""A session's ranks as one SLURM job: nodes held once, a cell run on them in milliseconds.

The job runs torchrun on every node (c10d rendezvous on the first one); its ranks reach
the kernel's TCP channel, named in the session's run folder on the shared filesystem
with the key beside it (both 0600, the folder 0700: only the user who started the
session can reach it), and wait there for each run as a local session's ranks do. The
channel authenticates every frame (``_wire.channel``).

The kernel cannot signal a rank on another node: it interrupts one with a message, and
stops them all by cancelling the job. Closing the channel makes the ranks at rest exit,
so a kernel that dies, however it dies, ends the job too. The job's state while it
waits in the queue goes to ``on_status``.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable

from .._run.records import Records
from .._run.shape import GroupShape
from .._run.waiting import WaitingGroup
from .._wire.channel import ChannelServer, new_key, tcp_address
from .._wire.messages import Interrupt
from .._wire.rundir import RunDir
from .launcher import JobStatus, SlurmLauncher, kernel_host, sbatch
from .options import SlurmOptions
from .sbatch import session_sbatch_text

logger = logging.getLogger(__name__)

_OPEN: set[SlurmSessionGroup] = set()
_OPEN_LOCK = threading.Lock()


@atexit.register
def _cancel_open_jobs() -> None:
    """At the kernel's exit, cancel every session job still held (the ranks would end
    by themselves as the channel closes; this also ends one still in the queue)."""
    with _OPEN_LOCK:
        groups = list(_OPEN)
    for group in groups:
        group.stop()
        group.close()


class SlurmSessionGroup(WaitingGroup):
    """A session's ranks as the SLURM job submitted now for ``shape`` and ``options``."""

    launcher_name = "the SLURM job"

    def __init__(self, shape: GroupShape, options: SlurmOptions) -> None:
        super().__init__(shape, RunDir.of_job(Records.create().path))
        self.options = options
        self.status = JobStatus("UNKNOWN")
        self.on_status: Callable[[JobStatus], None] | None = None
        """Told of each change of the job's state (from the thread that follows it)."""
        self._stopped = False
        with _OPEN_LOCK:
            _OPEN.add(self)
        try:
            key = new_key()
            self.run_dir.write_private(self.run_dir.key, key)
            host = tcp_address(kernel_host())
            self._server = ChannelServer((host, 0), key, self._deliver)
            self.run_dir.write_private(self.run_dir.address,
                                       f"{host} {self._server.port}".encode())
            self._submit()
        except BaseException:
            self.stop()
            self.close()
            raise

    def _submit(self) -> None:
        self.run_dir.sbatch.write_text(session_sbatch_text(
            str(self.run_dir.path), self.shape.python, self.options, self.shape.prepare))
        job_id = sbatch(self.run_dir.sbatch, dict(self.shape.env), self.shape.cwd)
        self.slurm_job_id, self.where = job_id, f"SLURM job {job_id}"
        self._follow_launcher(SlurmLauncher(job_id, self._job_changed))

    def _job_changed(self, status: JobStatus) -> None:
        self.status = status
        tell = self.on_status
        if tell is not None:
            tell(status)

    def interrupt(self, ranks: set[int]) -> None:
        """Ask each rank of ``ranks`` to raise ``KeyboardInterrupt`` in the user's code."""
        assert self._server is not None
        for rank in ranks:
            self._server.send(rank, Interrupt())

    def stop(self, clean: bool = False) -> None:
        """Cancel the job and wait until it has left the queue (or, ``clean``, let it end
        by itself first: the ranks at rest exit when the channel closes)."""
        super().stop(clean)
        self._stopped = True
        self._forget_when_done()

    def close(self) -> None:
        super().close()
        self._forget_when_done()

    def _forget_when_done(self) -> None:
        """Stopped and closed: nothing is left for the exit hook to end."""
        if self._stopped and self._closed:
            with _OPEN_LOCK:
                _OPEN.discard(self)
