"""How a local rank group shares this machine's cores with the notebook.

The cores this machine gives the kernel's process, and so its ranks: the CPUs it may
run on (its affinity: a SLURM step's or a cpuset's share of the machine), no more than
its cgroup's CPU quota allows (a container's ``--cpus``, a Kubernetes CPU limit), which
the affinity does not show. Read where the quota is mounted in the process's own view
(``/sys/fs/cgroup``: a container's own cgroup); a quota set further up is not seen.
From them follows whether a group's ranks speak through a relay (which needs a core of
its own).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

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
