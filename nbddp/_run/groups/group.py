"""Rank groups: the ranks of a run, their private run dir, the channel, their launcher.

A group can exist before any payload. A local group starts torchrun at once; its ranks
connect, import torch, join their gloo group if the run will use one, and wait for their
``Start`` (this is what standby ranks are). ``hand_over`` gives a group its run: the
payload, the records folder, the rank options and what changed in the notebook since
the ranks started. A session's group (``reusable``) is handed one run after another.
Any of a waiting group's processes may have died while idle: before the Start, the
ranks that wait for it answer a roll call, and a group that lost one is not handed the
run (``RanksGone``: the caller stops it and starts fresh ranks).
A SLURM group has no standby: handing it over submits the batch job.

The run (``Job``) reads a group's ``events``, and ends it with ``stop`` (every process)
and ``close`` (channel, run dir). Whatever started the ranks, torchrun here or a batch
job there, is a ``Launcher`` that the group waits on and stops: one protocol, no
branches in the run.
"""

from __future__ import annotations

import contextlib
import queue
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ... import _version
from ..._errors import NbddpError
from ..._wire.channel import ChannelServer
from ..._wire.dataplane import Packed
from ..._wire.hang_messages import Collectives, ShowCollectives, ShowStacks, Stacks
from ..._wire.messages import RankOptions, Sequenced, Start
from ..._wire.rundir import RunDir
from ..._wire.stacks import STACKS_WAIT
from ..diagnosis.asking import Question
from ..diagnosis.stack_view import render
from ..records import Records
from .shape import Handover


class Launcher(Protocol):
    """What started a group's ranks, as the group sees it."""

    def add_rank(self, pid: int) -> None:
        """A rank said hello with its PID (a local launcher stops it by that PID)."""

    def wait(self) -> int:
        """Block until the launcher has ended; its exit code."""

    def stop(self, clean: bool = False) -> None:
        """Stop every process; ``clean`` (every rank returned): let it end by itself first."""

    def stopped_from_outside(self) -> str | None:
        """Why the ranks were stopped by someone else (e.g. SLURM's time limit), if so."""


@dataclass(frozen=True)
class LauncherExited:
    """Kernel-side event: the group's launcher ended with ``code``."""

    code: int


class RankGroup:
    """What every group has: ``nprocs`` ranks, a private run dir, their messages."""

    where = ""
    """Where the ranks run when not on this machine, for the panel."""
    notice: str | None = None
    """A line for the notebook when the run starts on this group."""
    cluster_job_id: str | None = None
    """The cluster's own id for the job the ranks run in (SLURM's job id, a Ray
    session's id): what ``attach`` takes. None for ranks on this machine."""
    ends_after_result = False
    """After every rank returned, the run's value may be given before the launcher has
    ended: true where the kernel owns the processes (and sees them off regardless)."""
    reusable = False
    """A session's group: its ranks go back to rest after each run, for the next."""
    launcher_name = "torchrun"
    """What started the ranks, as the notebook names it when it stops."""
    hears_link_ends = True
    """A rank whose link to the kernel closes is said to be gone (``Disconnected``)."""

    def __init__(self, nprocs: int, run_dir: RunDir) -> None:
        self.nprocs, self.run_dir = nprocs, run_dir
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.launcher: Launcher | None = None
        self.records: Records | None = None
        self._server: ChannelServer | None = None
        self._closed = False
        self._closing = threading.Lock()
        self._collectives = Question(Collectives)
        self._stacks = Question(Stacks)

    def _follow_launcher(self, launcher: Launcher) -> None:
        self.launcher = launcher
        threading.Thread(target=self._wait_launcher, args=(launcher,), daemon=True,
                         name="nbddp-launcher").start()

    def _wait_launcher(self, launcher: Launcher) -> None:
        self.events.put(LauncherExited(launcher.wait()))

    def release_held(self) -> None:
        """Put on ``events`` what the group held back to put on together (a waiting
        group's Results: see ``WaitingGroup``); here, nothing is held."""

    def _start_message(self, payload: Path, records: Records, options: RankOptions,
                       handover: Handover) -> Start:
        twin = self.run_dir.twin
        return Start(_version.__version__, str(records.path), str(payload), options,
                     handover.cwd, dict(handover.env), session=self.reusable,
                     data=str(twin) if twin is not None else None)

    def new_records(self) -> Records:
        """The records folder for the run this group is about to be given."""
        return Records.create()

    def interrupt(self, ranks: set[int]) -> None:
        """Interrupt the user's code on ``ranks`` (a session's; others are stopped)."""

    def stacks(self, wait: float = STACKS_WAIT, full: bool = False) -> dict[int, str]:
        """Every rank's Python stacks, as ``stack_view.render`` shows them (``full``: every
        frame and thread), sent back over the channel (a rank on another machine cannot
        be signalled); a rank that does not answer within ``wait`` s (and a moment for the
        network) is left out."""
        answers = self._stacks.ask(range(self.nprocs), self._asker(ShowStacks), wait + 1.0)
        return {rank: render(rank, answer.dump, answer.main, full)
                for rank, answer in answers.items() if answer.dump is not None}

    def collectives(self, wait: float = STACKS_WAIT) -> dict[int, Collectives]:
        """Where each rank the channel reaches is in its collectives (torch's flight
        recorder, read by the rank); a rank that does not answer within ``wait`` s is left
        out."""
        return self._collectives.ask(range(self.nprocs), self._asker(ShowCollectives),
                                     wait + 1.0)  # (and a moment for the network)

    @property
    def can_ask(self) -> bool:
        """Whether the kernel can ask the ranks anything: a channel reaches them (a SLURM
        job's may report through files alone)."""
        return self._server is not None

    def _answers_question(self, message: Any) -> bool:
        """True if ``message`` (numbered or not) answers one of the questions above (then
        it is taken)."""
        inner = message.message if isinstance(message, Sequenced) else message
        return self._collectives.took(inner) or self._stacks.took(inner)

    def _asker(self, question: Callable[[int], Any]) -> Callable[[int, int], bool]:
        """How a ``Question`` sends ``question(call)`` to a rank over the channel."""
        server = self._server
        return lambda rank, call: server is not None and server.send(rank, question(call))

    def hand_over(self, payload: Packed, records: Records, options: RankOptions,
                  handover: Handover) -> None:
        raise NotImplementedError

    def hooks(self, supervisor: Any) -> GroupHooks:
        """This backend's part in following a run on the group (see ``GroupHooks``);
        ``supervisor`` is the run's ``Supervisor`` (a backend names its type: this module
        does not, as the supervisor imports it)."""
        return GroupHooks(supervisor)

    def sync(self) -> None:
        """Read now whatever the ranks sent through slower links (mailbox files)."""

    def send_to_rank(self, rank: int, message: Any) -> bool:
        """Tell one rank something (pdb's input); False if it cannot be reached."""
        return self._server is not None and self._server.send(rank, message)

    def stopped_from_outside(self) -> str | None:
        return self.launcher.stopped_from_outside() if self.launcher else None

    def launcher_tail(self, lines: int = 30) -> str:
        """The end of the launcher's output (why a group broke)."""
        try:
            text = self.run_dir.launcher_log.read_text(errors="replace")
        except OSError:
            return "(nothing)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, clean: bool = False) -> None:
        """Stop every process of the group (and wait until they are gone)."""
        if self.launcher is not None:
            self.launcher.stop(clean)

    def retire(self) -> None:
        """Every rank returned: see the processes off (they are ending by themselves),
        and close the channel and the run dir."""
        self.stop(clean=True)
        self.close()

    def close(self) -> None:
        """After ``stop``: close the channel, keep torchrun's log with the run's records,
        remove the run dir. A second caller waits until the first is done."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            if self._server is not None:
                self._server.close()
            if self.records is not None and \
                    self.records.launcher_log != self.run_dir.launcher_log:
                with contextlib.suppress(OSError), \
                        open(self.run_dir.launcher_log, "rb") as log, \
                        open(self.records.launcher_log, "ab") as kept:
                    shutil.copyfileobj(log, kept)  # (after a session's earlier groups')
            self.run_dir.remove()


class GroupHooks:
    """A backend's part in following one run on its group; this one adds nothing.

    A backend's hooks register, with ``supervisor.pump``, handlers for its own events
    (a SLURM job's queue state) and for the messages only its ranks send, and a hook
    that sees each rank message as it arrives (``on_arrival``). The supervisor asks them
    two more things when the run would end.
    """

    def __init__(self, supervisor: Any) -> None:
        self.supervisor = supervisor  # the run's Supervisor (see RankGroup.hooks)

    def moved_on(self) -> bool:
        """A rank failed: True if the backend already follows the ranks' next start
        instead (SLURM requeues the job, which stopped them); the failure ends nothing."""
        return False

    def ended_early(self) -> BaseException | None:
        """The launcher ended before every rank returned: the run's error, if the backend
        knows why (else the supervisor looks at the ranks' reports)."""
        return None


class RanksGone(NbddpError):
    """A waiting group cannot take its run: one of its processes stopped while it waited
    (a rank, or torchrun), or a rank did not answer its roll call. No rank was sent the
    Start; the group is to be stopped, and fresh ranks started."""

    def __init__(self, why: str) -> None:
        super().__init__(f"the waiting ranks cannot take the run: {why}")
        self.why = why
        """What happened, e.g. ``"rank 1 had stopped"``."""
