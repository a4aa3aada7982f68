"""The options of one run: a frozen dataclass, validated once, before anything starts."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .devices import _parse_visible_devices, visible_gpu_count

#: Ranks started when no GPU is visible and ``nprocs`` is not given: two ranks are the
#: fewest that exercise the distributed code paths (all-reduce, sharded samplers).
CPU_DEFAULT_NPROCS = 2

OUTPUT_CHOICES = ("rank0", "all", "none")
#: Two minutes without a line of output or a step from any rank: long enough for a slow
#: first batch or a compile, short enough to notice a hang while waiting for it.
DEFAULT_STALL_AFTER = 120.0
_CPU_HINT = "to run on the CPU instead, pass nprocs=N (ranks use gloo) and leave gpus unset"


@dataclass(frozen=True)
class RunConfig:
    """What to start and how; ``RunConfig.resolve`` fills in the defaults."""

    nprocs: int
    """Number of ranks (processes) on this machine."""
    backend: str | None = None
    """Process-group backend; ``None`` picks NCCL on a GPU rank, gloo otherwise."""
    timeout: float | None = None
    """Seconds the whole run may take before every rank is stopped."""
    init: bool = True
    """Initialise (and destroy) the default process group around the user's function."""
    all_ranks: bool = False
    """Return every rank's value, in rank order, instead of rank 0's."""
    cuda_visible_devices: str | None = None
    """``CUDA_VISIBLE_DEVICES`` for the ranks, when the user picked GPUs."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables for every rank."""
    output: str = "rank0"
    """Whose output is shown live: ``"rank0"``, ``"all"`` (each line prefixed), ``"none"``."""
    max_restarts: int = 0
    """How many times torchrun restarts every rank after one fails (``--max-restarts``)."""
    stall_after: float | None = DEFAULT_STALL_AFTER
    """Seconds without output or progress from any rank after which the panel says the
    run looks stalled; None never says it."""

    def __post_init__(self) -> None:
        if isinstance(self.nprocs, bool) or not isinstance(self.nprocs, int):
            raise TypeError(f"nprocs must be an int, got {self.nprocs!r}")
        if self.nprocs < 1:
            raise ValueError(f"nprocs must be at least 1, got {self.nprocs}")
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            raise ValueError(
                f"backend must be a name such as 'nccl' or 'gloo', got {self.backend!r}")
        if self.timeout is not None and not (
            isinstance(self.timeout, (int, float)) and self.timeout > 0
        ):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        check_max_restarts(self.max_restarts)
        if self.stall_after is not None and (
                isinstance(self.stall_after, bool) or not isinstance(self.stall_after, (int, float))
                or self.stall_after <= 0):
            raise ValueError(f"stall_after must be a positive number of seconds or None, got "
                             f"{self.stall_after!r}")
        if self.output not in OUTPUT_CHOICES:
            raise ValueError(f"output must be one of {OUTPUT_CHOICES}, got {self.output!r}")
        bad_env = [k for k, v in self.env.items()
                   if not (isinstance(k, str) and isinstance(v, str))]
        if bad_env:
            raise TypeError(f"env must map str to str; bad entries: {bad_env}")

    @classmethod
    def resolve(
        cls,
        nprocs: int | None = None,
        gpus: int | Sequence[int] | None = None,
        **options,
    ) -> RunConfig:
        """Turn the user's ``nprocs``/``gpus`` into a rank count and device selection."""
        available = visible_gpu_count()
        if gpus is not None:
            devices = _select_gpus(gpus, available)
            if nprocs is not None and nprocs != len(devices):
                raise ValueError(f"nprocs={nprocs} disagrees with gpus={gpus!r} "
                                 f"({len(devices)} GPUs); give one or the other")
            return cls(nprocs=len(devices), cuda_visible_devices=",".join(devices), **options)
        backend = options.get("backend")
        if nprocs is None:
            nprocs = available if available and backend != "gloo" else CPU_DEFAULT_NPROCS
        if backend == "nccl" and available == 0:
            raise ValueError(f"backend='nccl' needs GPUs, and no GPU is visible; {_CPU_HINT}")
        one_gpu_per_rank = available and backend in (None, "nccl")
        if one_gpu_per_rank and isinstance(nprocs, int) and nprocs > available:
            raise ValueError(
                f"nprocs={nprocs} asks for one GPU per rank, but only {available} GPU(s) are "
                "visible; lower nprocs, or pass backend='gloo' for CPU ranks")
        return cls(nprocs=nprocs, **options)


def check_max_restarts(value: object) -> None:
    """``max_restarts`` is a count: an int, 0 or more."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_restarts must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"max_restarts must be 0 or more, got {value}")


RESTART_SAFE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""For torchrun when it may restart the ranks. By default its workers share the
rendezvous store, where a restarted attempt reads the failed attempt's addresses and
cannot connect (pytorch/pytorch#135712); a store of their own per attempt avoids that,
for nbddp's process group and for one a user's code creates."""


def torchrun_environment(max_restarts: int) -> dict[str, str]:
    """What torchrun's environment needs for ``max_restarts``."""
    return dict(RESTART_SAFE_ENV) if max_restarts else {}


def _select_gpus(gpus: int | Sequence[int], available: int) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` entries for ``gpus`` (a count, or indices)."""
    if isinstance(gpus, bool) or not isinstance(gpus, (int, Sequence)) or isinstance(gpus, str):
        raise TypeError(f"gpus must be a count or a list of GPU indices, got {gpus!r}")
    indices = list(range(gpus)) if isinstance(gpus, int) else list(gpus)
    if not indices or any(not isinstance(i, int) or i < 0 for i in indices):
        raise ValueError(f"gpus must be a positive count or non-negative indices, got {gpus!r}")
    if len(set(indices)) != len(indices):
        raise ValueError(f"gpus lists a GPU twice: {gpus!r}")
    if max(indices) >= available:
        wanted = f"{gpus} GPU(s)" if isinstance(gpus, int) else f"GPU(s) {indices}"
        raise ValueError(
            f"asked for {wanted}, but only {available} GPU(s) are visible; {_CPU_HINT}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in indices]
    ids = _parse_visible_devices(visible)
    return [ids[i] for i in indices]
