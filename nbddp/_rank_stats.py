"""What a rank says of itself about once a second while it runs: where it is (host, pid),
how far it got (its last step), what it holds (memory) and whether it still writes.

Read from ``/proc`` and torch's allocator, on the rank's reporting thread: nothing here
touches the training thread, and no CUDA context is created where there was none.
"""

from __future__ import annotations

import functools
import os
import socket
import sys

from ._messages import RankStats

_MB = 2**20


@functools.cache
def _host_and_page() -> tuple[str, int]:
    """Asked once, on the first sample (not when ``nbddp`` is imported)."""
    return socket.gethostname(), os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float | None:
    """This process's resident memory."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _host_and_page()[1] / _MB
    except (OSError, ValueError, IndexError):
        return None


def gpu_mem_mb() -> float | None:
    """What torch's CUDA allocator holds on this rank's GPU; None where CUDA is not in use."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        return torch.cuda.memory_reserved() / _MB
    except RuntimeError:
        return None


def output_bytes() -> int:
    """How much the rank has written to its log (stdout and stderr both go there)."""
    try:
        return os.fstat(1).st_size
    except OSError:
        return 0


def sample(rank: int, step: int | None) -> RankStats:
    host = _host_and_page()[0]
    return RankStats(rank, host, os.getpid(), step, rss_mb(), gpu_mem_mb(), output_bytes())
