"""The SLURM backend: a run as a batch job, a session as one job (or a job step of the
allocation the kernel runs in), and attaching to either from a new kernel.

``nprocs`` (or ``gpus``) count ranks per node. A session waits for its job to leave the
queue, saying each change of its state, and its ranks outlive the kernel for ``grace``
seconds (None: as long as the job runs), so ``Session.attach`` reconnects a new kernel.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from .._errors import NbddpError
from .._run.backend import Backend, follow
from .._run.cluster_kind import Attached, ClusterKind, ClusterShape, flags_say
from .._run.config import RunConfig, RunOptions
from .._run.flags import flag_values
from .._run.groups.shape import GroupShape
from .._run.groups.waiting import WaitingGroup
from .._run.job import Job
from .._run.records import records_root
from .._wire.dataplane import Packed
from .._wire.rundir import RunDir
from .group import SlurmGroup
from .launcher import find_run_dir
from .options import Slurm, SlurmOptions, cluster_run
from .session import SessionRecord, SlurmSessionGroup, running_sessions
from .step import Allocation

START_TIMEOUT = 300.0
"""How long a session job's ranks may take to wait for their first run, once it runs."""
ATTACH_WAIT = 30.0
"""How long the ranks of a session's job may take to reconnect to a kernel that attaches
(they look for it twice a second, once their last kernel has gone)."""


class SlurmBackend(Backend):
    """Runs and sessions as SLURM jobs with ``options``; ``grace``: how long a session's
    ranks outlive the kernel."""

    start_timeout = START_TIMEOUT
    ships_code = True

    def __init__(self, config: RunConfig, options: SlurmOptions,
                 grace: float | None = None) -> None:
        super().__init__(config)
        self.options = options
        self.grace = grace

    def start_run(self, payload: Packed) -> Job:
        return follow(SlurmGroup.for_submission(self.config, self.options), self.config, payload)

    def shape(self) -> GroupShape:
        """The shape of the ranks on the cluster's nodes: their GPUs, not this machine's."""
        return dataclasses.replace(GroupShape.of(self.config), cuda_visible_devices=None,
                                   gpus=self.options.gpus_per_node)

    def session_group(self, standby: bool = True) -> WaitingGroup:
        return SlurmSessionGroup.start(self.shape(), self.options, self.grace,
                                       {"timeout": self.config.timeout,
                                        "output": self.config.output})

    def wait_placed(self, group: WaitingGroup) -> bool:
        """Wait for the job to leave the queue and for its ranks to be ready, saying each
        change of the job's state. The time in the queue is unbounded (Ctrl-C cancels);
        the ranks' start, ``START_TIMEOUT``."""
        assert isinstance(group, SlurmSessionGroup)
        running_since = None
        if group.step_of is not None:
            print(f"nbddp: the session's ranks start as a job step of SLURM allocation "
                  f"{group.step_of.job_id} ({group.step_of.nodelist})", flush=True)
        while not group.wait_ready(0.1) and not group.broken:
            _say(group)
            if group.status.state == "RUNNING" and running_since is None:
                running_since = time.monotonic()
            if running_since is not None and \
                    time.monotonic() - running_since > self.start_timeout:
                return False
        _say(group)
        return group.is_ready

    def started(self, group: WaitingGroup) -> None:
        assert isinstance(group, SlurmSessionGroup)
        job = group.cluster_job_id
        if self.grace == 0:
            return
        lasts = "as long as the job runs" if self.grace is None else f"for {self.grace:g} s"
        print(f"nbddp: the ranks outlive this kernel {lasts}: after a restart, "
              f"%ddp_session attach {job} (or nbddp.Session.attach({job!r})) reconnects; "
              "%ddp_session stop ends the job", flush=True)

    def place(self, group: WaitingGroup) -> str:
        assert isinstance(group, SlurmSessionGroup)
        nodes = group.status.nodes
        return f"SLURM job {group.cluster_job_id}" + (f" on {nodes}" if nodes else "")

    def hosts(self, group: WaitingGroup, last: Job | None) -> dict[int, str]:
        return {} if last is None else {rank: info["host"] for rank, info in last.ranks.items()
                                        if info["host"]}

    def left(self, group: WaitingGroup) -> bool:
        return isinstance(group, SlurmSessionGroup) and group.detached


def _say(group: SlurmSessionGroup) -> None:
    for line in group.take_unsaid():
        print(line, flush=True)


def slurm_backend(options: RunOptions, slurm: bool | Slurm) -> SlurmBackend:
    """A batch run's backend: ``slurm`` (True: the defaults) checked with ``options``."""
    config, cluster = cluster_run(options, slurm)
    return SlurmBackend(config, cluster)


def slurm_session_backend(options: RunOptions, slurm: bool | Slurm,
                          grace: float | None) -> SlurmBackend:
    """A session's backend: where the kernel runs in an allocation, its job step takes
    all of the allocation's nodes; a session's job takes no option that would restart it."""
    config, cluster = cluster_run(options, _on_the_allocation(slurm))
    _check_session_job(cluster, grace)
    return SlurmBackend(config, cluster, grace)


def attach_session(job_id: str | int | None
                   ) -> tuple[SlurmBackend, SlurmSessionGroup, frozenset[str]]:
    """The backend and the ranks of the session whose SLURM job is ``job_id`` (without
    it: this account's one running session job), reconnected to this kernel with their
    state, and the names kept on them. Only the user who started the session can
    attach: the key is theirs."""
    found = running_sessions(None if job_id is None else str(job_id))
    if len(found) != 1:
        raise NbddpError(_no_single_session(found, job_id))
    record, run_dir = found[0]
    config = RunConfig(nprocs=record.nprocs, backend=record.backend, init=record.init,
                       timeout=record.timeout, output=record.output)
    backend = SlurmBackend(config, record.options, record.grace)
    group = SlurmSessionGroup.attached(backend.shape().unknown(), run_dir, record)
    try:
        ready = group.wait_ready(ATTACH_WAIT)
    except BaseException:  # Ctrl-C: the job stays for another try
        group.detach()
        raise
    if not ready:
        why = _not_attached(group, record.job_id)
        group.detach()
        raise NbddpError(why)
    names = frozenset(group.names or ())
    print(f"nbddp: attached to the session on SLURM job {record.job_id} ({record.nprocs} "
          f"ranks, {len(names)} names kept on them)", flush=True)
    return backend, group, names


def attach_run(job_id: str | int, run_dir: str | os.PathLike | None = None) -> Job:
    """Follow a run submitted to SLURM again: found by its id among this account's
    run folders, or in ``run_dir``."""
    folder = find_run_dir(str(job_id)) if run_dir is None else RunDir.of_job(Path(run_dir))
    group = SlurmGroup.attached(folder)
    try:
        return Job(group, group.config, group.new_records())
    except BaseException:
        group.stop()
        group.close()
        raise


def _check_session_job(options: SlurmOptions, grace: float | None) -> None:
    """What a batch run may ask of SLURM that a session's job cannot do (yet)."""
    asked = [name for name, value in (("requeue", options.requeue),
                                      ("signal_before", options.signal_before),
                                      ("max_restarts", options.max_restarts)) if value]
    if asked:
        raise ValueError(f"a session's SLURM job does not take {', '.join(asked)}: its ranks "
                         "keep state that a restart would lose")
    if grace is not None and (isinstance(grace, bool) or not isinstance(grace, (int, float))
                              or grace < 0):
        raise ValueError(f"grace is a number of seconds, 0 or more (or None), got {grace!r}")


def _on_the_allocation(slurm: bool | Slurm) -> bool | Slurm:
    """Where the kernel runs in an allocation, the session's job step takes all of its
    nodes (``Allocation.check`` refuses other choices)."""
    allocation = Allocation.here()
    if allocation is None:
        return slurm
    chosen = Slurm() if slurm is True else slurm
    if not isinstance(chosen, Slurm):
        return slurm  # (cluster_run says what is wrong with it)
    allocation.check(chosen.options(1, 0))
    return dataclasses.replace(chosen, nodes=allocation.nodes)


def _not_attached(group: SlurmSessionGroup, job_id: str) -> str:
    """Why the ranks of a session's job did not come to a kernel that attached."""
    if group.broken:
        return f"SLURM job {job_id} ended before its ranks came back"
    if group.status.state == "PENDING":
        return (f"SLURM job {job_id} waits in the queue ({group.status.reason}): its "
                "ranks are gone; stop it, and start a new session")
    return (f"the ranks of SLURM job {job_id} did not come within {ATTACH_WAIT:g} s: another "
            "kernel still attached to them keeps them (stop or restart it first), or they "
            "are still finishing the cell that was running")


def _no_single_session(found: list[tuple[SessionRecord, RunDir]],
                       job_id: str | int | None) -> str:
    """Why ``Session.attach`` cannot choose: no session job runs, or several do."""
    if not found:
        which = f"SLURM job {job_id} is not" if job_id is not None else "no SLURM job is"
        return (f"{which} a running session of this account (under {records_root()}); "
                "start one with %ddp_session start --slurm")
    lines = [f"  SLURM job {record.job_id}: {_count(record.nprocs, 'rank')} on "
             f"{_count(record.options.nodes, 'node')}, started "
             f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(record.started))}"
             for record, _ in found]
    return ("several session jobs run; attach to one by its id "
            "(%ddp_session attach JOBID):\n" + "\n".join(lines))


def _count(number: int, thing: str) -> str:
    return f"{number} {thing}" + ("" if number == 1 else "s")


class SlurmKind(ClusterKind):
    """SLURM, as the front door finds it: ``cluster=nbddp.Slurm(...)``, ``--slurm``."""

    name, title, options = "slurm", "SLURM", Slurm
    run_help = ("submit the cell as a SLURM batch job (sbatch) and follow it here: queue "
                "state, output, metrics, result; interrupting the cell runs scancel")
    session_help = ("start the ranks as one SLURM job (sbatch) that holds its nodes for the "
                    "session: --nprocs or --gpus ranks per node; the cell shows the queue "
                    "wait and returns when every rank is ready")

    def run_backend(self, options: RunOptions, chosen: Any) -> Backend:
        return slurm_backend(options, chosen)

    def session_backend(self, options: RunOptions, chosen: Any,
                        grace: float | None) -> Backend:
        return slurm_session_backend(options, chosen, grace)

    def attaches(self, job_id: str | int | None) -> bool:
        return True  # (asked last: a job id that no other kind claims is SLURM's)

    def attach_session(self, job_id: str | int | None) -> Attached:
        return attach_session(job_id)

    def attach_run(self, job_id: str | int, run_dir: str | os.PathLike | None) -> Job:
        return attach_run(job_id, run_dir)

    def unchosen(self, given: list[str], exporting: bool, session: bool) -> str | None:
        submitted_only = [flag for flag in given if flag in _SUBMITTED_ONLY]
        if session:
            return (f"{flags_say(given, 'describe')} a SLURM job: add --slurm to start the "
                    "session's ranks as one")
        if not exporting and len(submitted_only) < len(given):
            return (f"{flags_say(given, 'describe')} a SLURM job: add --slurm to submit the "
                    "cell, or --export PATH to write it")
        if submitted_only:
            return (f"{' and '.join(submitted_only)} "
                    f"{'are' if len(submitted_only) > 1 else 'is'} for a job submitted from "
                    "the notebook: add --slurm")
        return None

    def from_flags(self, parsed: Any, shape: ClusterShape) -> Any:
        return Slurm(nodes=shape.nodes, **flag_values(Slurm, parsed))


_SUBMITTED_ONLY = ("--requeue", "--signal-before")
"""Flags for a job the notebook submits and follows, which an exported job file lacks."""
