"""Count the GPUs the ranks will see, without importing torch or initialising CUDA.

The kernel must stay free of CUDA, so this asks NVML (the driver's management
library, which creates no CUDA context) and applies ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import ctypes
import functools
import os

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
