"""The GPUs the ranks will see, and every check of the GPUs a run asks for.

The kernel must stay free of CUDA, so the count asks NVML (the driver's management
library, which creates no CUDA context) and applies ``CUDA_VISIBLE_DEVICES``.
``launch``, ``Session`` and the magics all come here (through
``RunOptions.on_this_machine``) to learn whether the GPUs asked for exist.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence

_UNSET = object()


@functools.cache
def _nvml_device_count() -> int:
    """The machine's GPUs, asked once per process (NVML's start-up is not free)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    count = ctypes.c_uint(0)
    if nvml.nvmlInit_v2() != 0:
        return 0
    try:
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return 0
        return count.value
    finally:
        nvml.nvmlShutdown()


def _parse_visible_devices(value: str) -> list[str]:
    """CUDA's own rule: entries up to the first invalid one (``-1`` hides all)."""
    entries = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        entries.append(entry)
    return entries


def visible_gpu_count(visible: str | None | object = _UNSET) -> int:
    """How many CUDA devices a process started now would see, with this environment's
    ``CUDA_VISIBLE_DEVICES`` or the value given (None: unset)."""
    physical = _nvml_device_count()
    if visible is _UNSET:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not isinstance(visible, str):
        return physical
    return min(physical, len(_parse_visible_devices(visible)))


CPU_HINT = "to run on the CPU instead, pass nprocs=N (ranks use gloo) and leave gpus unset"


class GpusNotVisible(ValueError):
    """``gpus`` names more GPUs than are visible (the magic says it in its flags' words)."""

    available: int = 0
    """The GPUs that are visible."""


def select_gpus(gpus: int | Sequence[int], available: int) -> list[str]:
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
        error = GpusNotVisible(
            f"asked for {wanted}, but only {available} GPU(s) are visible; {CPU_HINT}")
        error.available = available
        raise error
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in indices]
    ids = _parse_visible_devices(visible)
    return [ids[i] for i in indices]


def check_ranks_fit(nprocs: int, backend: str | None, available: int) -> None:
    """``nprocs`` ranks with ``backend`` (None: NCCL where there are GPUs) fit the
    ``available`` GPUs: NCCL needs one, and one GPU per rank means enough of them."""
    if backend == "nccl" and available == 0:
        raise ValueError(f"backend='nccl' needs GPUs, and no GPU is visible; {CPU_HINT}")
    one_gpu_per_rank = available and backend in (None, "nccl")
    if one_gpu_per_rank and nprocs > available:
        raise ValueError(
            f"nprocs={nprocs} asks for one GPU per rank, but only {available} GPU(s) are "
            "visible; lower nprocs, or pass backend='gloo' for CPU ranks")
