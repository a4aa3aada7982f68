"""The local backend: runs and sessions on torchrun ranks of this machine.

A one-off run goes to the standby group when one waits with a shape it can take up, and
to a group started now otherwise (also when the standby group lost a process: it is
stopped, and the run says so); its end starts the next standby group. A session's ranks
are taken from standby too, or started now.
"""

from __future__ import annotations

import functools
import logging

from .._run.backend import Backend, follow
from .._run.config import RunConfig, RunOptions
from .._run.groups.group import RanksGone
from .._run.groups.shape import GroupShape
from .._run.groups.waiting import WaitingGroup
from .._run.job import Job, data_bytes, note_under
from .._run.records import Records, SessionRecords
from .._wire.dataplane import Packed
from .._wire.kept_storages import KeptStorages, kernels_copies
from .group import LocalGroup
from .standby import STANDBY, START_TIMEOUT, replaced, wanted_by

logger = logging.getLogger(__name__)


class LocalBackend(Backend):
    """torchrun on this machine: standby ranks where they wait, else started now."""

    start_timeout = START_TIMEOUT
    keeps_snapshots = True

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.shape = GroupShape.of(config)

    def start_run(self, payload: Packed) -> Job:
        """On the standby group if it can take the run, else on a group started now; the
        run's end starts the next standby group."""
        shape, config = self.shape, self.config

        def after(job: Job) -> None:  # the next launch likely sends and gets as much again
            STANDBY.refill(shape, functools.partial(note_under, job), *data_bytes(job))

        taken = STANDBY.take(shape)
        records, notice = None, taken.missed
        if taken.group is not None and taken.handover is not None:
            records = Records.create()  # kept for fresh ranks if these cannot take the run
            try:
                return follow(taken.group, config, payload, records, taken.handover, warm=True,
                              after=after)
            except RanksGone as gone:  # no rank had the run: stopped while fresh ones start
                STANDBY.retire(taken.group)
                notice = replaced(gone.why)
        group = LocalGroup(shape)
        group.notice = notice
        return follow(group, config, payload, records, after=after)

    def kernels_copies(self) -> KeptStorages | None:
        return kernels_copies()

    def session_group(self, standby: bool = True) -> WaitingGroup:
        taken = STANDBY.take(self.shape) if standby else None  # waiting ranks become the session's
        if taken is not None and taken.group is not None:
            return taken.group
        group = LocalGroup(self.shape)
        group.notice = taken.missed if taken is not None else None
        return group

    def wait_placed(self, group: WaitingGroup) -> bool:
        return group.wait_ready(self.start_timeout)

    def session_records(self) -> SessionRecords:
        return SessionRecords(self.config.nprocs)


def local_backend(options: RunOptions) -> LocalBackend:
    """The local backend for ``options``, checked for this machine (its GPUs)."""
    return LocalBackend(options.on_this_machine())


def warm_up(setting: str | None) -> None:
    """Start standby ranks of the shape a ``launch(fn)`` without options runs on (one per
    visible GPU, or two gloo ranks), if standby is on and was by ``NBDDP_STANDBY`` as
    nbddp loaded (``setting``), and none wait yet: the first run of a fresh kernel then
    starts warm too. Never raises: a warm-up that fails leaves the first run to start
    cold, as it would have."""
    if not (wanted_by(setting) and STANDBY.enabled) or STANDBY.state().status != "none":
        return
    try:
        shape = GroupShape.of(RunOptions().on_this_machine())
        STANDBY.refill(shape, lambda line: logger.info("nbddp: %s", line))
    except Exception:  # noqa: BLE001 - the first run starts cold and says why, if anything
        logger.debug("nbddp: no warm-up", exc_info=True)
