"""What a rank says of itself about once a second while it runs: where it is (host, pid),
how far it got (its last step), what it holds (memory) and whether it still writes.

Read from ``/proc`` and torch's allocator, on the rank's reporting thread: nothing here
touches the training thread, and no CUDA context is created where there was none. That
thread's current GPU is always the first (a thread does not inherit
``torch.cuda.set_device``), so the GPU is named: the one the rank's main thread set up.
"""

from __future__ import annotations

import functools
import os
import socket
import sys

from .._wire.rank_stats import RankStats
from .._wire.rundir import NODE_NAME_ENV

_MB = 2**20
_device: int | None = None  # the GPU this rank's main thread chose (use_device)


@functools.cache
def _host_and_page() -> tuple[str, int]:
    """Asked once, on the first sample (not when ``nbddp`` is imported). The host is
    the node's name where its launcher gave one (a Ray node's: nodes that share a host
    name are told apart), as the rank's hello names it."""
    host = os.environ.get(NODE_NAME_ENV) or socket.gethostname()
    return host, os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float | None:
    """This process's resident memory."""
    global _statm_fd
    try:  # (one system call: a session's quick run reads it as it reports)
        resident = int(os.pread(_statm(), 256, 0).split()[1])
    except (OSError, ValueError, IndexError):
        _statm_fd = None  # (the user's code closed it, say: opened again next time)
        return None
    return resident * _host_and_page()[1] / _MB


def _statm() -> int:
    """``/proc/self/statm``, opened once per process and read again in place: opening
    it costs a path lookup in ``/proc`` on every sample. (Kept by process ID: a process
    forked from this one, a data loader's worker, opens its own.)"""
    global _statm_fd
    pid = os.getpid()
    if _statm_fd is None or _statm_fd[0] != pid:
        _statm_fd = (pid, os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
    return _statm_fd[1]


_statm_fd: tuple[int, int] | None = None


def use_device(index: int) -> None:
    """Called on the rank's main thread as it sets its GPU (``torch.cuda.set_device``):
    the GPU whose memory the stats report from now on."""
    global _device
    _device = index


def stats_device(device_count: int) -> int:
    """The GPU whose memory this rank's stats report, whichever thread asks: the one its
    main thread chose (``use_device``), else the one nbddp would choose: ``LOCAL_RANK``'s,
    if the rank sees that many GPUs (a rank given one GPU of its own through
    ``CUDA_VISIBLE_DEVICES`` sees it as the first)."""
    if _device is not None:
        return _device
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return local_rank if 0 <= local_rank < device_count else 0


def gpu_mem_mb() -> float | None:
    """What torch's CUDA allocator holds on this rank's GPU; None where CUDA is not in use."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        return torch.cuda.memory_reserved(stats_device(torch.cuda.device_count())) / _MB
    except (RuntimeError, ValueError, AssertionError):  # (an invalid device: an assertion)
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
