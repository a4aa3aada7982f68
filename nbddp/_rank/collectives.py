"""Where this rank is in its collectives, from torch's flight recorder.

torch records every collective each process group enters, numbered per group, in a ring
buffer (the flight recorder: on by default in recent torch, 2000 entries,
``TORCH_FR_BUFFER_SIZE``). gloo's groups record into the generic recorder
(``_dump_fr_trace``), NCCL's into their own (``_dump_nccl_trace``). The status says, per
group, the last collective entered and the last completed; the entries name them. That is
what a hang report needs from each rank: "rank 0 waits in all_reduce #12, rank 1 completed
#11". It is read from the link's thread while the main thread may wait inside a
collective (which holds no Python lock).

Where the recorder is off (``TORCH_FR_BUFFER_SIZE=0``) or this torch has none for the
backend, each process group's own count of the collectives it was asked for (its
sequence number) stands in: the last one entered. Whether that one completed is read
from the main thread's stack: inside one of ``torch.distributed``'s collectives (on that
group), or inside a backward (where DDP's gradient all-reduce runs), it waits.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
from types import FrameType
from typing import Any

from .._wire.hang_messages import GroupProgress

_RECORDERS = {"_dump_fr_trace": "gloo", "_dump_nccl_trace": "nccl"}
"""torch's dump functions, and the backend whose groups each records."""


def progress() -> tuple[tuple[GroupProgress, ...], str, str]:
    """This rank's progress in each process group it used, ``""`` and ``""``, from torch's
    flight recorder; or the groups' own counts, ``""`` and why the recorder could not say;
    or no groups, and why none can be said. Never raises."""
    dist = sys.modules.get("torch.distributed")  # (not imported here: a rank without
    if dist is None or not dist.is_available() or not dist.is_initialized():  # torch)
        return (), "no process group", ""
    try:
        traces = ("torch's flight recorder is off (TORCH_FR_BUFFER_SIZE=0)" if _recorder_off()
                  else _traces(str(dist.get_backend())))
        if not isinstance(traces, str):
            return _progress_in(traces, _counts(dist)), "", ""
        why = traces
    except Exception as exc:  # noqa: BLE001 - a recorder that fails must not stop the rank
        why = f"torch's flight recorder could not be read ({type(exc).__name__}: {exc})"
    try:
        return _counted(dist), "", why
    except Exception as exc:  # noqa: BLE001
        return (), f"{why}; the process groups' counts could not be read ({exc})", ""


def _counted(dist: Any) -> tuple[GroupProgress, ...]:
    """Each process group's own count (its sequence number), and the collective the main
    thread waits in (read from its stack), if any."""
    c10d = dist.distributed_c10d
    op, group = _main_thread_collective(c10d)
    groups = []
    for pg, name in list(c10d._world.pg_names.items()):
        entered = int(pg._get_sequence_number_for_group())
        label = getattr(pg, "group_desc", "") or ("default_pg" if name == "0" else name)
        waits = bool(op) and entered > 0 and (group is pg or group is None and name == "0")
        groups.append(GroupProgress(str(name), label, entered - 1 if waits else entered,
                                    entered, "", op if waits else ""))
    return tuple(groups)


_IN_BACKWARD = "all_reduce (in backward)"
"""Where DDP's gradient all-reduces run: the backward waits for them at its end."""


def _main_thread_collective(c10d: Any) -> tuple[str, Any]:
    """The ``torch.distributed`` collective the main thread is inside (its outermost
    public function there) and the group it was given (None: the default group, as for
    ``_IN_BACKWARD``, inside a backward); ``""`` elsewhere."""
    frame: FrameType | None = sys._current_frames().get(threading.main_thread().ident or 0)
    c10d_file, found, group = c10d.__file__, "", None
    while frame is not None:
        code = frame.f_code
        if code.co_filename == c10d_file and not code.co_name.startswith("_"):
            found, group = code.co_name, frame.f_locals.get("group")
        elif not found and code.co_name in ("_engine_run_backward", "backward") and \
                "autograd" in code.co_filename:
            found = _IN_BACKWARD
        frame = frame.f_back
    return found, group if found != _IN_BACKWARD else None


def _traces(backend: str) -> list[dict[str, Any]] | str:
    """The dumps of the recorders this rank's backend writes to (or why there are none)."""
    from torch._C import _distributed_c10d as c10d

    wanted = [name for name, kind in _RECORDERS.items() if kind in backend]
    dumps = [getattr(c10d, name) for name in wanted if hasattr(c10d, name)]
    if not dumps:
        import torch

        return f"torch {torch.__version__} has no flight recorder for {backend}"
    return [pickle.loads(dump(True, False, False)) for dump in dumps]  # noqa: S301 - torch's own bytes


def _counts(dist: Any) -> dict[str, GroupProgress]:
    """Each group's own count, by name, to check the recorder's against (none if they
    cannot be read)."""
    try:
        return {group.group: group for group in _counted(dist)}
    except Exception:  # noqa: BLE001 - the recorder's figures stand alone then
        return {}


def _progress_in(traces: list[dict[str, Any]],
                 counts: dict[str, GroupProgress] | None = None) -> tuple[GroupProgress, ...]:
    counts = counts or {}
    groups = []
    for trace in traces:
        entries = trace.get("entries", [])
        for pg_id, status in sorted(trace.get("pg_status", {}).items()):
            groups.append(_progress(str(pg_id), status, entries, counts))
    return tuple(groups) or (GroupProgress("0", "default_pg", 0, 0),)  # (none yet)


def _recorder_off() -> bool:
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        value = os.environ.get(name)
        if value is not None:
            return value.strip() == "0"
    return False


def _progress(pg_id: str, status: dict[str, Any], entries: list[dict[str, Any]],
              counts: dict[str, GroupProgress]) -> GroupProgress:
    """One group's progress. The status is keyed by the group's id in this process, which
    may differ across ranks; its entries name the group as every rank does.

    The recorder may lag: gloo's groups mark a collective completed some time after it
    returned, so a rank long past it, or waiting in a later one, would be shown still
    waiting in it. Where the group's own count and the main thread's stack (``counts``)
    say more collectives completed, they stand; the entries still name them."""
    completed = max(int(status.get("last_completed_collective", 0)), 0)  # (-1: none yet)
    entered = max(int(status.get("last_enqueued_collective", 0)), 0)
    mine = [entry for entry in entries
            if str(entry.get("pg_id")) == pg_id and not entry.get("is_p2p")]
    name, label = _group_of(mine[-1]) if mine else ("0" if pg_id == "0" else pg_id, "")
    counted = counts.get(name)
    if counted is not None and counted.completed > completed:
        completed, entered = counted.completed, max(entered, counted.entered)
    by_number = {entry.get("collective_seq_id"): entry for entry in mine}
    done, waiting = by_number.get(completed, {}), by_number.get(completed + 1, {})
    since = waiting.get("time_created_ns") if entered > completed else None
    waiting_op = _operation(waiting) or (counted.waiting_op if counted else "")
    return GroupProgress(name, label or ("default_pg" if name == "0" else name),
                         completed, entered, _operation(done),
                         waiting_op if entered > completed else "",
                         since / 1e9 if since else None)


def _group_of(entry: dict[str, Any]) -> tuple[str, str]:
    names = entry.get("process_group") or ("", "")
    return str(names[0]), str(names[1]) if len(names) > 1 else ""


def _operation(entry: dict[str, Any]) -> str:
    """``gloo:all_reduce`` -> ``all_reduce``."""
    return str(entry.get("profiling_name", "")).rpartition(":")[2]
