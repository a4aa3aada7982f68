"""``launch()``: run a function on every rank of a fresh torchrun process group.

A local launch runs on the standby group when one waits with a shape it can take up,
and on a group started now otherwise (also when the standby group lost a process while
it waited: it is stopped, and the run says so); a SLURM launch submits a batch job.
Either way the group is handed the payload and a ``Job`` follows the run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

from ._local.group import LocalGroup
from ._local.standby import STANDBY, wanted_by
from ._run.config import DEFAULT_STALL_AFTER, RunConfig, RunOptions
from ._run.group import RankGroup, RanksGone
from ._run.job import Job
from ._run.records import Records
from ._run.shape import GroupShape, Handover
from ._slurm.group import SlurmGroup
from ._slurm.launcher import find_run_dir
from ._slurm.options import Slurm, cluster_run
from ._wire.dataplane import Packed
from ._wire.kept_storages import kernels_copies
from ._wire.payload import Payload
from ._wire.rundir import RunDir

logger = logging.getLogger(__name__)

R = TypeVar("R")


@overload
def launch(
    fn: Callable[..., R],
    nprocs: int | None = ...,
    *,
    args: Sequence[Any] = ...,
    kwargs: Mapping[str, Any] | None = ...,
    gpus: int | Sequence[int] | None = ...,
    backend: str | None = ...,
    timeout: float | None = ...,
    init: bool = ...,
    all_ranks: bool = ...,
    wait: Literal[False],
    env: Mapping[str, str] | None = ...,
    output: Literal["rank0", "all", "none"] = ...,
    max_restarts: int = ...,
    stall_after: float | None = ...,
    pdb: bool = ...,
    slurm: bool | Slurm = ...,
) -> Job[R]: ...
@overload
def launch(
    fn: Callable[..., R],
    nprocs: int | None = ...,
    *,
    args: Sequence[Any] = ...,
    kwargs: Mapping[str, Any] | None = ...,
    gpus: int | Sequence[int] | None = ...,
    backend: str | None = ...,
    timeout: float | None = ...,
    init: bool = ...,
    all_ranks: Literal[True],
    wait: Literal[True] = ...,
    env: Mapping[str, str] | None = ...,
    output: Literal["rank0", "all", "none"] = ...,
    max_restarts: int = ...,
    stall_after: float | None = ...,
    pdb: bool = ...,
    slurm: bool | Slurm = ...,
) -> list[R]: ...
@overload
def launch(
    fn: Callable[..., R],
    nprocs: int | None = ...,
    *,
    args: Sequence[Any] = ...,
    kwargs: Mapping[str, Any] | None = ...,
    gpus: int | Sequence[int] | None = ...,
    backend: str | None = ...,
    timeout: float | None = ...,
    init: bool = ...,
    all_ranks: Literal[False] = ...,
    wait: Literal[True] = ...,
    env: Mapping[str, str] | None = ...,
    output: Literal["rank0", "all", "none"] = ...,
    max_restarts: int = ...,
    stall_after: float | None = ...,
    pdb: bool = ...,
    slurm: bool | Slurm = ...,
) -> R: ...


def launch(
    fn: Callable[..., R],
    nprocs: int | None = None,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    gpus: int | Sequence[int] | None = None,
    backend: str | None = None,
    timeout: float | None = None,
    init: bool = True,
    all_ranks: bool = False,
    wait: bool = True,
    env: Mapping[str, str] | None = None,
    output: Literal["rank0", "all", "none"] = "rank0",
    max_restarts: int = 0,
    stall_after: float | None = DEFAULT_STALL_AFTER,
    pdb: bool = False,
    slurm: bool | Slurm = False,
) -> R | list[R] | Job[R]:
    """Run ``fn(*args, **kwargs)`` on every rank of a fresh DDP process group.

    ``fn`` may be defined in the notebook; it ships by value with what it uses. Each
    rank starts in a new process under ``torchrun`` with the default process group
    initialised (NCCL on a GPU rank, else gloo) unless ``init=False``. Returns rank 0's
    return value, every rank's with ``all_ranks=True``, or a ``Job`` with
    ``wait=False``. ``nprocs=None`` runs one rank per visible GPU (or the ``gpus``
    chosen), and 2 CPU ranks on a machine without GPUs. Rank 0's output is shown live
    (``output="all"``: every rank's, each line prefixed with its rank; ``"none"``: none).
    ``env`` adds environment variables for the ranks. ``max_restarts=N``: when a rank
    fails, torchrun stops every rank and starts them all again, up to N times (each
    attempt runs ``fn`` from the start; ``nbddp.restart_count()`` says which attempt).
    When no rank has printed or advanced for ``stall_after`` seconds, the output says
    the run looks stalled, where each rank is and who waits for whom (``Job.stacks()``
    and ``Job.hang_report()`` ask again). ``pdb=True``: when a rank raises, pdb opens in
    the notebook at the failing frame of that rank, with its variables, before the ranks
    are stopped; ``q`` ends it and the ``WorkerError`` is raised.

    Every run gets fresh processes. After a run, the next run's ranks start in the
    background and wait (see ``standby``), so the next launch of the same shape starts
    in a fraction of a second; ``Job.warm`` says whether a run used them.

    ``slurm=Slurm(nodes=2, ...)`` (or ``True``) submits the run as a SLURM batch job
    instead, with ``nprocs``/``gpus`` ranks per node, and follows it in the same way:
    queue state, then output, metrics and result. Interrupting stops it (``scancel``).

    Raises ``WorkerError`` when a rank fails, ``TimeoutError`` after ``timeout``
    seconds, ``PayloadError`` when something cannot be sent; nothing is left running.
    """
    __tracebackhide__ = True  # IPython shows the user's call, not nbddp's frames
    options = RunOptions(nprocs=nprocs, gpus=gpus, backend=backend, timeout=timeout, init=init,
                         all_ranks=all_ranks, env=env, output=output,
                         max_restarts=max_restarts, stall_after=stall_after, pdb=pdb)
    cluster = None
    if slurm is not False:
        config, cluster = cluster_run(options, slurm)
    else:
        config = options.on_this_machine()
    here = kernels_copies() if cluster is None else None  # (ranks that map this machine's memory)
    payload = Payload.capture(fn, tuple(args), dict(kwargs or {})).dumps(here)
    job: Job[R] = Job.started_held(
        lambda: _start_here(config, payload) if cluster is None else
        _start(SlurmGroup.for_submission(config, cluster), config, payload))
    return _follow(job, wait)


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


def _start_here(config: RunConfig, payload: Packed) -> Job:
    """On the standby group if it can take the run, else on a group started now; the
    run's end starts the next standby group."""
    shape = GroupShape.of(config)

    def after(job: Job) -> None:  # the next launch likely sends and gets as much again
        STANDBY.refill(shape, job._note, *job._data_bytes)

    taken = STANDBY.take(shape)
    records, notice = None, None
    if taken is not None:
        records = Records.create()  # kept for fresh ranks if these cannot take the run
        try:
            return _start(taken[0], config, payload, records, taken[1], warm=True, after=after)
        except RanksGone as gone:  # it is being stopped; no rank had the run
            notice = f"nbddp: standby ranks replaced ({gone.why}); this run starts on fresh ranks"
    group = LocalGroup(shape)
    group.notice = notice
    return _start(group, config, payload, records, after=after)


def _start(group: RankGroup, config: RunConfig, payload: Packed, records: Records | None = None,
           handover: Handover | None = None, warm: bool = False,
           after: Callable[[Job], None] | None = None) -> Job:
    """Hand ``group`` the run and follow it; if that fails, stop the group (standby
    ranks that cannot take the run: in the background, while fresh ones start)."""
    try:
        records = records or group.new_records()
        group.hand_over(payload, records, config.rank_options, handover or Handover())
        return Job(group, config, records, warm=warm, sent=payload.buffer_bytes, after=after)
    except RanksGone:
        assert isinstance(group, LocalGroup)
        STANDBY.retire(group)
        raise
    except BaseException:
        group.stop()
        group.close()
        raise


def _follow(job: Job, wait: bool) -> Any:
    __tracebackhide__ = True
    return job.result() if wait else job._handed_back()


def attach(job_id: str | int, run_dir: str | os.PathLike | None = None) -> Job:
    """Follow a run submitted with ``slurm=`` again, e.g. after a kernel restart.

    The job is found by its id among this account's run folders, or in ``run_dir``. Its
    output and metrics so far are shown again, then live; ``result()`` returns rank 0's
    value once it ends, or raises its error.
    """
    folder = find_run_dir(str(job_id)) if run_dir is None else RunDir.of_job(Path(run_dir))
    group = SlurmGroup.attached(folder)
    try:
        job: Job = Job(group, group.config, group.new_records())
    except BaseException:
        group.stop()
        group.close()
        raise
    return _follow(job, wait=False)


def last_job() -> Job | None:
    """The ``Job`` of the latest ``launch``, ``%%ddp`` cell or session run in this
    process, if any: its ``history`` of rank-averaged metrics, ``logs`` and ``records``."""
    return Job._latest
