"""A SLURM rank group: the ranks of a batch job, reached over TCP or mailbox files."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .._run.config import RunConfig
from .._run.groups.group import GroupHooks, RankGroup
from .._run.groups.shape import Handover
from .._run.records import Records
from .._wire import dataplane
from .._wire.channel import ChannelServer, tcp_address
from .._wire.dataplane import Packed
from .._wire.frames import encode
from .._wire.handshake import new_key
from .._wire.mailbox import MailboxReader
from .._wire.messages import Disconnected, RankOptions
from .._wire.rundir import RunDir, address_text
from .follow import RequeueCount, SlurmHooks
from .launcher import SlurmLauncher, kernel_host, read_shape, submit
from .options import SlurmOptions

if TYPE_CHECKING:
    from .._run.supervisor import Supervisor

logger = logging.getLogger(__name__)


class SlurmGroup(RankGroup):
    """A batch job's ranks: they report over TCP when they can reach the kernel, and
    always through mailbox files in the run folder (which is also its records)."""

    hears_link_ends = False  # (a rank's mailbox speaks for it: see ``_deliver``)

    def __init__(self, config: RunConfig, run_dir: RunDir) -> None:
        super().__init__(config.nprocs, run_dir)
        self.config = config
        self.options: SlurmOptions | None = None
        self.records = Records(run_dir.path)
        self.requeues = RequeueCount()
        """SLURM's requeues of the job, as the ranks' messages and SLURM tell them."""
        self._mailbox = MailboxReader(run_dir.path, config.nprocs, self._deliver)

    @classmethod
    def for_submission(cls, config: RunConfig, options: SlurmOptions) -> SlurmGroup:
        """A run folder on the shared filesystem and a TCP channel, ready for ``hand_over``."""
        group = cls(config, RunDir.of_job(Records.create().path))
        group.options = options
        try:
            group._listen()
        except BaseException:
            group.stop()
            group.close()
            raise
        return group

    def _listen(self) -> None:
        """The TCP channel, on the one address the ranks are told to use; none where
        this machine's name for itself does not resolve (the ranks then report through
        their mailbox files alone, as they do when they cannot reach the kernel)."""
        key = new_key()
        self.run_dir.write_private(self.run_dir.key, key)
        try:
            host = tcp_address(kernel_host())
        except ConnectionError as exc:
            logger.info("nbddp: no TCP channel for the ranks: %s", exc)
            return
        self._server = ChannelServer((host, 0), key, self._deliver)
        self.run_dir.write_private(self.run_dir.address, address_text(host, self._server.port))

    @classmethod
    def attached(cls, run_dir: RunDir) -> SlurmGroup:
        """The group of a job submitted earlier (e.g. before a kernel restart)."""
        shape = read_shape(run_dir)
        config = RunConfig(nprocs=shape["nprocs"], all_ranks=shape["all_ranks"],
                           output=shape["output"])
        Records(run_dir.path).metrics.unlink(missing_ok=True)  # rebuilt from the mailboxes
        group = cls(config, run_dir)
        group.sync()  # everything written so far: which requeue of the job the ranks are on
        group._follow(shape["job_id"], f"nbddp: attached to SLURM job {shape['job_id']}")
        return group

    def _deliver(self, message: Any) -> None:
        if self._answers_question(message):
            return
        if not isinstance(message, Disconnected):  # the rank's mailbox still speaks for it
            self.requeues.saw(message)
            self.events.put(message)

    def _follow(self, job_id: str, notice: str) -> None:
        self.cluster_job_id, self.where, self.notice = job_id, f"SLURM job {job_id}", notice
        self._follow_launcher(SlurmLauncher(job_id, self.events.put))

    def new_records(self) -> Records:
        assert self.records is not None
        return self.records

    def hand_over(self, payload: Packed, records: Records, options: RankOptions,
                  handover: Handover) -> None:
        """Write the payload and the ranks' Start into the run folder, and submit."""
        dataplane.write(self.run_dir.payload, payload)
        self.run_dir.write_private(self.run_dir.start, encode(
            self._start_message(self.run_dir.payload, records, options, handover)))
        assert self.options is not None
        job_id = submit(self.run_dir, self.config, self.options)
        self._follow(job_id, f"nbddp: submitted SLURM job {job_id}; after a kernel restart, "
                             f"nbddp.attach({job_id!r}) follows it again")

    def hooks(self, supervisor: Supervisor) -> GroupHooks:
        assert self.cluster_job_id is not None  # submitted, or attached to
        return SlurmHooks(supervisor, self.cluster_job_id, self.requeues)

    def sync(self) -> None:
        self._mailbox.poll()

    def stop(self, clean: bool = False) -> None:
        super().stop(clean)
        self._mailbox.close()  # after a last read of what the ranks wrote

