"""Standby ranks: the next launch's rank group, started after a run and waiting for it.

After a local run that the ranks ended themselves (every rank returned, or one failed),
a group of the same shape starts in the background: torchrun and its ranks, torch
imported, the gloo group joined if the run will use gloo, connected to the kernel and
waiting for a ``Start``. A launch whose shape the group can take up (see
``GroupShape.handover``) is handed to it and starts in a fraction of a second; any other
launch starts cold, and the waiting group is stopped. So is a group that lost a process
while it waited (a rank or torchrun killed, e.g. by the out-of-memory killer): it is no
longer offered once that is seen, and a launch that takes it before finds out from the
roll call of its hand-over (see ``_local.group``) and starts cold. An interrupt, a cancel or a
timeout starts none: the user stopped things on purpose.

One group waits per kernel. It stops after ``idle_timeout`` seconds unused, on
``standby(False)``, when the kernel exits, and with the kernel's death (torchrun's
lifeline). The panel of the run that started it shows what it is doing on its last line.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from .._run.groups.shape import GroupShape, Handover
from .._run.interrupt_hold import pressed_now
from .group import LocalGroup

logger = logging.getLogger(__name__)

DEFAULT_IDLE_TIMEOUT = 600.0
START_TIMEOUT = 300.0  # a group not ready by then is stuck: it is stopped
_OFF = ("0", "false", "no", "off")
_READY_LOOK = 0.05  # how often a wait for a starting group looks for Ctrl-C

Note = Callable[[str], None]


@dataclass(frozen=True)
class StandbyState:
    """What ``nbddp.standby()`` says: the setting, and the group waiting now, if any."""

    enabled: bool
    idle_timeout: float
    """Seconds an unused standby group waits before it stops."""
    status: str
    """``"off"``, ``"none"`` (nothing waits yet), ``"starting"`` or ``"ready"``."""
    nprocs: int | None = None
    pids: tuple[int, ...] = ()
    """torchrun's and the ranks' process ids."""


@dataclass(frozen=True)
class Taken:
    """What ``Standby.take`` found for a launch: the waiting group and what it must
    change, or none; ``missed``: why standby ranks meant for it could not take it."""

    group: LocalGroup | None = None
    handover: Handover | None = None
    missed: str | None = None
    """``standby ranks replaced (rank 1 had stopped)``, said under the run."""


class _Detached(NamedTuple):
    """The group taken out of standby, its note, when it started, and why the group
    before it was lost unused (and its shape), if it was."""

    group: LocalGroup | None
    note: Note | None
    started: float
    lost: tuple[str, GroupShape] | None


def _ready_by(group: LocalGroup, deadline: float) -> bool:
    """Wait until every rank of ``group`` waits for its Start: False if the group broke,
    ``deadline`` passed, or Ctrl-C was pressed meanwhile (the run then stops as
    interrupted)."""
    while not group.wait_ready(_READY_LOOK):
        if group.broken or time.monotonic() > deadline or pressed_now():
            return False
    return True


def replaced(why: str) -> str:
    """What the notebook is told when standby ranks could not take a run, and ``why``."""
    return f"nbddp: standby ranks replaced ({why}); this run starts on fresh ranks"


def _why_lost(group: LocalGroup) -> str:
    return replaced(group.gone or "the ranks stopped while they started")


def wanted_by(setting: str | None) -> bool:
    """Whether ``NBDDP_STANDBY`` (this value of it; None: unset) leaves standby on."""
    return (setting or "1").strip().lower() not in _OFF


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


class Standby:
    """The one waiting group of this kernel, and the rules for starting and stopping it."""

    def __init__(self) -> None:
        self.enabled = wanted_by(os.environ.get("NBDDP_STANDBY"))
        self.idle_timeout = DEFAULT_IDLE_TIMEOUT
        self._lock = threading.Lock()
        self._group: LocalGroup | None = None
        self._note: Note | None = None
        self._started = 0.0
        self._announced = False
        self._lost: tuple[str, GroupShape] | None = None
        """Why the last group stopped while it waited, unused, and its shape."""
        self._timer: threading.Timer | None = None
        self._retiring: list[threading.Thread] = []
        atexit.register(self.shutdown)

    # --- launches -------------------------------------------------------------------

    def take(self, shape: GroupShape) -> Taken:
        """The waiting group and what it must change, if it can run a launch of ``shape``;
        otherwise none, and the group (if any) is stopped. A group still starting is
        waited for (it is ahead of one started now): the run is handed to ranks that are
        all up, whose roll call then covers every one. ``Taken.missed`` says why ranks
        that would have taken the run did not (one of their processes stopped)."""
        group, _, started, lost = self._detach()
        if group is None:
            return Taken(missed=lost[0] if lost and lost[1].handover(shape) else None)
        handover = group.shape.handover(shape)
        if handover is None:
            self.retire(group)
            return Taken()
        if not _ready_by(group, started + START_TIMEOUT):
            self.retire(group)
            return Taken(missed=None if pressed_now() else _why_lost(group))
        return Taken(group, handover)

    def refill(self, shape: GroupShape, note: Note, payload: int = 0, result: int = 0) -> None:
        """Start the group for the next launch, with shared memory allocated ahead for a
        payload and a result of the last sizes; ``note`` shows its state to the user."""
        if not self.enabled:
            return
        group = LocalGroup(shape)
        group.make_room(payload, result)
        with self._lock:
            old, self._group, self._note = self._group, group, note
            self._started, self._announced, self._lost = time.monotonic(), False, None
            self._restart_timer(START_TIMEOUT, "standby: stopped; the ranks were not ready "
                                               f"after {_minutes(START_TIMEOUT)}")
        if old is not None:
            self.retire(old)
        note(f"standby: starting {shape.nprocs} ranks for the next launch")
        group.on_change = self._changed

    # --- the waiting group's life ---------------------------------------------------

    def _changed(self, group: LocalGroup) -> None:
        """Called from the group's threads as its ranks connect, get ready or die."""
        with self._lock:
            if group is not self._group or group.handed_over:
                return
            note = self._note
            if group.broken:
                self._group = self._note = None
                self._lost = (_why_lost(group), group.shape)  # the next launch says so
                line = "standby: the ranks stopped before use; the next launch starts cold"
            elif group.is_ready and not self._announced:
                self._announced = True
                self._restart_timer()
                line = (f"standby: {group.nprocs} ranks ready for the next launch (started in "
                        f"{time.monotonic() - self._started:.1f} s; they stop after "
                        f"{_minutes(self.idle_timeout)} unused)")
            else:
                return
        if group.broken:
            self.retire(group)
        if note is not None:
            note(line)

    def _restart_timer(self, seconds: float | None = None, line: str | None = None) -> None:
        """(Under the lock) stop the current group ``seconds`` from now (by default: the
        idle timeout, counted from when it is ready)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        if self._group is not None:
            seconds = self.idle_timeout if seconds is None else seconds
            line = line or f"standby: stopped after {_minutes(seconds)} unused"
            self._timer = threading.Timer(seconds, self._stop_current, args=(line,),
                                          kwargs={"only": self._group})
            self._timer.daemon = True
            self._timer.start()

    def _detach(self, only: LocalGroup | None = None) -> _Detached:
        """Take the current group (only if it is ``only``, when given) out of standby."""
        with self._lock:
            if only is not None and self._group is not only:
                return _Detached(None, None, 0.0, None)
            detached = _Detached(self._group, self._note, self._started, self._lost)
            self._group = self._note = self._lost = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        return detached

    def _stop_current(self, line: str, wait: bool = False,
                      only: LocalGroup | None = None) -> None:
        group, note, _, _ = self._detach(only)
        if group is None:
            return
        if wait:
            group.retire(clean=False)
        else:
            self.retire(group)
        if note is not None:
            note(line)

    def retire(self, group: LocalGroup) -> None:
        """Stop a group that will not be used (e.g. one that lost a rank), in the
        background; the kernel's exit waits for it."""
        def stop() -> None:
            try:
                group.retire(clean=False)
            except Exception:
                logger.exception("nbddp: stopping standby ranks failed")

        thread = threading.Thread(target=stop, daemon=True, name="nbddp-standby-stop")
        with self._lock:
            self._retiring = [t for t in self._retiring if t.is_alive()] + [thread]
        thread.start()

    # --- the user's controls --------------------------------------------------------

    def configure(self, enabled: bool | None, idle_timeout: float | None) -> StandbyState:
        if enabled is not None and not isinstance(enabled, bool):
            raise TypeError(f"standby(enabled) takes True or False, got {enabled!r}")
        if idle_timeout is not None and (isinstance(idle_timeout, bool) or not isinstance(
                idle_timeout, (int, float)) or not idle_timeout > 0):
            raise ValueError(f"idle_timeout must be a positive number of seconds, got "
                             f"{idle_timeout!r}")
        if idle_timeout is not None:
            with self._lock:
                self.idle_timeout = float(idle_timeout)
                if self._announced:  # a ready group's idle time counts from now
                    self._restart_timer()
        if enabled is not None:
            self.enabled = enabled
            if not enabled:
                self._stop_current("standby: stopped (nbddp.standby(False))", wait=True)
        return self.state()

    def state(self) -> StandbyState:
        with self._lock:
            group = self._group
        if not self.enabled:
            return StandbyState(False, self.idle_timeout, "off")
        if group is None:
            return StandbyState(True, self.idle_timeout, "none")
        return StandbyState(True, self.idle_timeout, "ready" if group.is_ready else "starting",
                            group.nprocs, tuple(group.pids()))

    def shutdown(self) -> None:
        """At exit: stop the waiting group, and wait for those being stopped."""
        self._stop_current("standby: stopped (the kernel is exiting)", wait=True)
        with self._lock:
            retiring = list(self._retiring)
        for thread in retiring:
            thread.join(timeout=10)


STANDBY = Standby()


def standby(enabled: bool | None = None, *, idle_timeout: float | None = None) -> StandbyState:
    """Turn standby ranks on or off, and set how long unused ones wait; says their state.

    With standby on (the default; ``NBDDP_STANDBY=0`` in the environment turns it off),
    each local run that ends by itself starts the next run's ranks in the background:
    torch imported, the gloo group joined, waiting. The next launch of the same shape
    (ranks, GPUs, backend, ``init``, and no change to variables read at start such as
    ``CUDA_*``, ``NCCL_*`` or ``OMP_*``) runs on them at once, in fresh processes as
    always; any other launch starts cold. They create no CUDA context while they wait,
    and stop after ``idle_timeout`` seconds unused (default 600), on ``standby(False)``,
    and with the kernel. Called without arguments, it only reports.
    """
    return STANDBY.configure(enabled, idle_timeout)
