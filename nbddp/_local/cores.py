"""How a local rank group shares this machine's cores with the notebook.

The cores this machine gives the kernel's process, and so its ranks: the CPUs it may
run on (its affinity: a SLURM step's or a cpuset's share of the machine), no more than
its cgroup's CPU quota allows (a container's ``--cpus``, a Kubernetes CPU limit), which
the affinity does not show. Read where the quota is mounted in the process's own view
(``/sys/fs/cgroup``: a container's own cgroup); a quota set further up is not seen.
From them follow whether a group's ranks speak through a relay (which needs a core of
its own) and whether they run as batch work (so that the notebook, not a rank, runs
first where they fill the cores).
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (a type only: this module reads the machine, nothing of nbddp's)
    from .._run.groups.shape import GroupShape

CGROUP = Path("/sys/fs/cgroup")


def usable_cores(cgroup: Path = CGROUP) -> int:
    """The cores this process may keep busy at once."""
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    quota = cpu_quota(cgroup)
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def cpu_quota(cgroup: Path = CGROUP) -> float | None:
    """The CPUs the cgroup's quota allows (cgroup v2's ``cpu.max``, or v1's
    ``cpu.cfs_quota_us`` over its period); None where none is set or none can be read."""
    v2 = _read(cgroup / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
    else:
        quota = _read(cgroup / "cpu" / "cpu.cfs_quota_us") or "-1"
        period = _read(cgroup / "cpu" / "cpu.cfs_period_us") or "0"
    try:
        allowed, per = float(quota), float(period)
    except ValueError:  # ("max": no quota)
        return None
    return allowed / per if allowed > 0 and per > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


RELAY_FROM = 16
"""Ranks from which a group's ranks talk to the kernel through a relay (``_rank.relay``),
on a machine with a core to spare for it (``uses_relay``)."""


def uses_relay(nprocs: int) -> bool:
    """Whether a group of ``nprocs`` ranks on this machine talks to the kernel through a
    relay: from ``RELAY_FROM`` ranks, where this process may use more cores than there
    are ranks (``usable_cores``). The relay takes the kernel's work per rank and cell (a
    Start sent, a report read) into a process of its own, which pays where that process
    has a core; where the ranks fill every core it takes CPU from them, and every cell
    is slower (benchmarks/README.md, bench_scale)."""
    return nprocs >= RELAY_FROM and usable_cores() > nprocs


def runs_as_batch(shape: GroupShape) -> bool:
    """Whether a local group's processes run as batch work (``schedule_as_batch``): ranks
    that see no GPU do, started by a kernel under Linux's default policy. Ranks that see
    a GPU keep the default: where their cores are busy, a thread that drives the GPU
    (NCCL's proxy, a CUDA stream's callback) must run as soon as it wakes. A kernel
    started under another policy (``chrt -i``, a real-time one) passes its own on to its
    ranks, as the user chose: it is neither raised nor lowered."""
    return shape.gpus == 0 and _scheduled_as_default()


def _scheduled_as_default() -> bool:
    """This thread runs under Linux's default policy (``SCHED_OTHER``)."""
    try:
        return os.sched_getscheduler(0) == os.SCHED_OTHER
    except (AttributeError, OSError):  # (not Linux)
        return False


def schedule_as_batch(pid: int) -> None:
    """Make ``pid`` (torchrun, before it starts anything: its ranks and their threads
    inherit it) batch work to Linux's scheduler (``SCHED_BATCH``: same share of the CPU,
    but a thread that wakes up does not preempt the one running). The ranks share the
    kernel's machine: where they fill its cores, the notebook is the interactive
    process, and it, not a rank, runs first when both wake; the ranks, which wake one
    another at every collective, stop preempting each other too (an all-reduce cell
    takes less time: benchmarks/README.md, bench_scale). Where the platform has no such policy, or a
    process is gone, nothing changes."""
    with contextlib.suppress(AttributeError, OSError):  # (not Linux; a process gone)
        os.sched_setscheduler(pid, os.SCHED_BATCH, os.sched_param(0))
