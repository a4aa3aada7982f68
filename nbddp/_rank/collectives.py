"""Where this rank is in its collectives, from torch's flight recorder.

torch records every collective each process group enters, numbered per group, in a ring
buffer (the flight recorder: on by default for gloo and NCCL in recent torch, 2000 entries,
``TORCH_FR_BUFFER_SIZE``). Its status says, per group, the last collective entered and the
last completed; its entries name them. That is what a hang report needs from each rank:
"rank 0 waits in all_reduce #12, rank 1 completed #11". It is read from the link's thread
while the main thread may wait inside a collective (which holds no Python lock).
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from .._wire.messages import GroupProgress


def progress() -> tuple[tuple[GroupProgress, ...], str]:
    """This rank's progress in each process group it used, and ``""``; or no groups and
    why none can be said."""
    try:
        import torch
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d
    except ImportError as exc:
        return (), f"torch.distributed is not available ({exc})"
    if not dist.is_available() or not dist.is_initialized():
        return (), "no process group"
    dump = getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return (), f"torch {torch.__version__} has no flight recorder"
    if _recorder_off():
        return (), "torch's flight recorder is off (TORCH_FR_BUFFER_SIZE=0)"
    try:
        trace = pickle.loads(dump(True, False, False))  # noqa: S301 - torch's own bytes, in-process
    except Exception as exc:  # noqa: BLE001 - a recorder that fails must not stop the rank
        return (), f"torch's flight recorder could not be read ({exc})"
    statuses = trace.get("pg_status") or {"0": {}}  # (none before a group's first collective)
    return tuple(_progress(name, status, trace.get("entries", []))
                 for name, status in sorted(statuses.items())), ""


def _recorder_off() -> bool:
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        value = os.environ.get(name)
        if value is not None:
            return value.strip() == "0"
    return False


def _progress(group: str, status: dict[str, Any], entries: list[dict[str, Any]]) -> GroupProgress:
    completed = max(int(status.get("last_completed_collective", 0)), 0)  # (-1: none yet)
    entered = max(int(status.get("last_enqueued_collective", 0)), 0)
    mine = {entry.get("collective_seq_id"): entry for entry in entries
            if _group_of(entry)[0] == group and not entry.get("is_p2p")}
    done, waiting = mine.get(completed, {}), mine.get(completed + 1, {})
    label = _group_of(done or waiting or next(iter(mine.values()), {}))[1]
    since = waiting.get("time_created_ns") if entered > completed else None
    return GroupProgress(group, label or ("default_pg" if group == "0" else group),
                         completed, entered, _operation(done),
                         _operation(waiting) if entered > completed else "",
                         since / 1e9 if since else None)


def _group_of(entry: dict[str, Any]) -> tuple[str, str]:
    names = entry.get("process_group") or ("", "")
    return str(names[0]), str(names[1]) if len(names) > 1 else ""


def _operation(entry: dict[str, Any]) -> str:
    """``gloo:all_reduce`` -> ``all_reduce``."""
    return str(entry.get("profiling_name", "")).rpartition(":")[2]
