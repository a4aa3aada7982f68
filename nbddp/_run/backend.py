"""What the front door asks of a backend: one neutral way to place and drive rank groups.

A backend (``_local``: torchrun on this machine; ``_slurm``: a SLURM job; later others)
is one object made for a run's options. The front door (``launch``, ``Session``, the
magics) only talks to it through this interface, so a new backend is a package beside
the others that subclasses ``Backend``, plus one line where the front door chooses
(``nbddp/_backends.py``):

- ``start_run``: a one-off run, handed to a group the backend starts (or has waiting),
  followed by a ``Job``;
- ``session_group``, ``wait_placed``, ``started``, ``not_ready``: a session's ranks,
  started, waited for until every one waits for its first run (a queue, a placement),
  what the user is told once they do, and why they did not;
- ``place``, ``hosts``: where the ranks run, as a session's status says it;
- ``kernels_copies``: whether the ranks map this machine's memory (tensors are then kept
  as copies the ranks map, see ``_wire.kept_storages``), ``ships_code``: whether the
  ranks' nodes may not see the notebook's files (the user's own modules then go with
  each payload that needs them, see ``_wire.shipped_code``), ``session_records``: how a
  session's cells are recorded.

Attaching to a session whose kernel went is a backend's own function (its ranks and its
records are its own); the front door lists them in ``_backends``.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from collections.abc import Callable

from .._errors import NbddpError
from .._wire.dataplane import Packed
from .._wire.kept_storages import KeptStorages
from .config import RunConfig
from .groups.group import RankGroup, RanksGone
from .groups.shape import Handover
from .groups.waiting import WaitingGroup
from .job import Job
from .records import FolderPerCell, Records, SessionRecords


class Backend(ABC):
    """Where the ranks of runs with ``config`` run, and how they are started."""

    start_timeout: float = 300.0
    """Seconds a session's ranks may take to start, once placed (a queue's wait aside)."""
    ships_code: bool = False
    """The ranks run on nodes that may not see the notebook's files: the user's own
    modules go with the payloads (``_wire.shipped_code``)."""
    keeps_snapshots: bool = False
    """A session's snapshots can be kept here (``_run.session.snapshots``): the ranks
    share this machine's shared memory with the kernel."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config

    # --- one-off runs ---------------------------------------------------------------

    @abstractmethod
    def start_run(self, payload: Packed) -> Job:
        """Hand a run of ``payload`` to a group of ranks; its ``Job``."""

    def kernels_copies(self) -> KeptStorages | None:
        """The kernel's kept copies of tensors, where the ranks map this machine's memory
        (None: tensors travel in the payload's data)."""
        return None

    # --- sessions -------------------------------------------------------------------

    @abstractmethod
    def session_group(self, standby: bool = True) -> WaitingGroup:
        """A session's ranks, being started (``standby``: ranks that already wait may be
        taken)."""

    @abstractmethod
    def wait_placed(self, group: WaitingGroup) -> bool:
        """Block until every rank of ``group`` waits for its first run, saying what the
        user should know meanwhile (a job's queue state); False if the group broke or
        took too long. Ctrl-C raises (the session then stops the group)."""

    def not_ready(self, group: WaitingGroup) -> NbddpError:
        """Why ``group``'s ranks did not come to wait for their first run, with what
        their launcher said (or that their versions differ from the kernel's)."""
        if group.refusal is not None:
            return NbddpError(f"the session's ranks cannot run here: {group.refusal}")
        problem = ("stopped" if group.broken
                   else f"were not ready after {self.start_timeout:g} s")
        outside = group.stopped_from_outside()
        because = f" ({outside})" if outside else ""
        return NbddpError(f"the session's ranks {problem}{because} before their first run; "
                          f"{group.launcher_name} said:\n{group.launcher_tail()}")

    def started(self, group: WaitingGroup) -> None:
        """The session's ranks wait: tell the user what they should know (how they end)."""
        return None

    def place(self, group: WaitingGroup) -> str:
        """Where the ranks run, if not on this machine (``SLURM job 12 on n[1-2]``)."""
        return ""

    def hosts(self, group: WaitingGroup, last: Job | None) -> dict[int, str]:
        """Each rank's machine: this one, or as the last run said."""
        return dict.fromkeys(range(self.config.nprocs), socket.gethostname())

    def left(self, group: WaitingGroup) -> bool:
        """The kernel left the group to another one (attached elsewhere): the session
        is over here, and nothing is to be restarted."""
        return False

    def session_records(self) -> SessionRecords | FolderPerCell:
        """Where a session's cells keep their logs and metrics."""
        return FolderPerCell(self.config.nprocs)


def follow(group: RankGroup, config: RunConfig, payload: Packed, records: Records | None = None,
           handover: Handover | None = None, warm: bool = False,
           after: Callable[[Job], None] | None = None) -> Job:
    """Hand ``group`` a one-off run and follow it with a ``Job``; if that fails, stop the
    group and raise. ``RanksGone`` (ranks that waited lost one: no rank had the run) is
    raised as it is, the group left to the backend to stop while fresh ranks start."""
    try:
        records = records or group.new_records()
        group.hand_over(payload, records, config.rank_options, handover or Handover())
        return Job(group, config, records, warm=warm, sent=payload.buffer_bytes, after=after)
    except RanksGone:
        raise
    except BaseException:
        group.stop()
        group.close()
        raise
