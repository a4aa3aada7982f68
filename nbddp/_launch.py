"""``launch()``: run a function on every rank of a fresh torchrun process group.

The backend chosen for the run's options (``_backends``: this machine, or a SLURM batch
job) starts its ranks and hands them the payload; a ``Job`` follows the run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar, overload

from ._backends import Ray, Slurm, attach_run, chosen_cluster, run_backend
from ._run.config import DEFAULT_STALL_AFTER, ClusterOptions, RunOptions
from ._run.job import Job, handed_back
from ._wire.payload import Payload
from ._wire.shipped_code import RanksCode
from ._wire.shipped_code import wanted as code_wanted

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
    cluster: ClusterOptions | None = ...,
    slurm: bool | Slurm = ...,
    ray: bool | Ray = ...,
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
    cluster: ClusterOptions | None = ...,
    slurm: bool | Slurm = ...,
    ray: bool | Ray = ...,
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
    cluster: ClusterOptions | None = ...,
    slurm: bool | Slurm = ...,
    ray: bool | Ray = ...,
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
    cluster: ClusterOptions | None = None,
    slurm: bool | Slurm = False,
    ray: bool | Ray = False,
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

    ``cluster=nbddp.Slurm(nodes=2, ...)`` submits the run as a SLURM batch job instead,
    with ``nprocs``/``gpus`` ranks per node, and follows it in the same way: queue state,
    then output, metrics and result. Interrupting stops it (``scancel``).
    ``cluster=nbddp.Ray(nodes=2, ...)`` runs it on a Ray cluster's nodes, ``nprocs`` ranks
    per node: placed, run and stopped as a session of one run. (``slurm=`` and ``ray=``
    are the older spelling of ``cluster=``: they still work, with a warning.)

    Raises ``WorkerError`` when a rank fails, ``TimeoutError`` after ``timeout``
    seconds, ``PayloadError`` when something cannot be sent; nothing is left running.
    """
    __tracebackhide__ = True  # IPython shows the user's call, not nbddp's frames
    options = RunOptions(nprocs=nprocs, gpus=gpus, backend=backend, timeout=timeout, init=init,
                         all_ranks=all_ranks, env=env, output=output,
                         max_restarts=max_restarts, stall_after=stall_after, pdb=pdb)
    chosen = chosen_cluster(cluster, slurm, ray)
    ranks = run_backend(options, chosen)  # (``backend`` is the process group's)
    payload = Payload.capture(fn, tuple(args), dict(kwargs or {})).dumps(
        ranks.kernels_copies(), code=RanksCode() if ranks.ships_code and code_wanted() else None)
    job: Job[R] = Job.started_held(lambda: ranks.start_run(payload))
    return _follow(job, wait)


def _follow(job: Job, wait: bool) -> Any:
    __tracebackhide__ = True
    return job.result() if wait else handed_back(job)


def attach(job_id: str | int, run_dir: str | os.PathLike | None = None) -> Job:
    """Follow a run submitted to SLURM (``cluster=nbddp.Slurm()``) again, e.g. after a
    kernel restart.

    The job is found by its id among this account's run folders, or in ``run_dir``. Its
    output and metrics so far are shown again, then live; ``result()`` returns rank 0's
    value once it ends, or raises its error.
    """
    return _follow(attach_run(job_id, run_dir), wait=False)


def last_job() -> Job | None:
    """The ``Job`` of the latest ``launch``, ``%%ddp`` cell or session run in this
    process, if any: its ``history`` of rank-averaged metrics, ``logs`` and ``records``."""
    return Job._latest
