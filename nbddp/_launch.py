"""``launch()``: run a function on every rank of a fresh torchrun process group."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar, overload

from ._config import RunConfig
from ._job import Job
from ._payload import Payload

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
) -> R | list[R] | Job[R]:
    """Run ``fn(*args, **kwargs)`` on every rank of a fresh DDP process group.

    ``fn`` may be defined in the notebook; it ships by value with what it uses. Each
    rank starts in a new process under ``torchrun`` with the default process group
    initialised (NCCL on a GPU rank, else gloo) unless ``init=False``. Returns rank 0's
    return value, every rank's with ``all_ranks=True``, or a ``Job`` with
    ``wait=False``. ``nprocs=None`` runs one rank per visible GPU (or the ``gpus``
    chosen), and 2 CPU ranks on a machine without GPUs. Rank 0's output is shown live
    (``output="all"``: every rank's, each line prefixed with its rank; ``"none"``: none).
    ``env`` adds environment variables for the ranks.

    Raises ``WorkerError`` when a rank fails, ``TimeoutError`` after ``timeout``
    seconds, ``PayloadError`` when something cannot be sent; nothing is left running.
    """
    config = RunConfig.resolve(nprocs, gpus, backend=backend, timeout=timeout, init=init,
                               all_ranks=all_ranks, env=dict(env or {}), output=output)
    options = {"init": init, "backend": backend, "all_ranks": all_ranks}
    payload = Payload.capture(fn, tuple(args), dict(kwargs or {}), options).dumps()
    global _last_job
    job: Job[R] = Job(config, payload)
    _last_job = job
    return job if not wait else job.result()


_last_job: Job | None = None


def last_job() -> Job | None:
    """The ``Job`` of the latest ``launch`` (or ``%%ddp`` cell) in this process, if any:
    its ``history`` of rank-averaged metrics, ``logs`` and ``records`` folder."""
    return _last_job
