"""Count the GPUs the ranks will see, without importing torch or initialising CUDA.

The kernel must stay free of CUDA, so this asks NVML (the driver's management
library, which creates no CUDA context) and applies ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import ctypes
import os


def _nvml_device_count() -> int:
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


def visible_gpu_count() -> int:
    """How many CUDA devices a process started now with this environment would see."""
    physical = _nvml_device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return physical
    return min(physical, len(_parse_visible_devices(visible)))
