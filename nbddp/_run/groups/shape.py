"""What a cold launch's ranks would see, and which differences waiting ranks can take up.

A rank group is started for a shape: interpreter, ranks, GPUs, backend, ``init``,
environment and working directory. A launch may use a group that is already waiting
(standby) when the two shapes differ at most in what a rank can still change before
the user's code runs: its working directory, and environment variables that nothing
read when the rank started. A change to anything the interpreter, torch, CUDA, NCCL,
gloo or a BLAS library read at start (``PYTHON*``, ``CUDA_*``, ``NCCL_*``, ``OMP_*``...)
means a cold start.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..config import RunConfig
from ..devices import visible_gpu_count

_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)

# Read when a rank's interpreter, torch, CUDA, NCCL, gloo, a BLAS or the C library
# started, or set by torchrun itself: a waiting rank cannot take up a change to them.
_READ_AT_START_PREFIXES = (
    "PYTHON", "LD_", "DYLD_", "MALLOC_", "LC_", "CUDA_", "CUBLAS", "CUDNN", "NVIDIA_",
    "NCCL_", "NVTE_", "TORCH", "PYTORCH_", "KINETO", "GLOO_", "OMP_", "KMP_", "MKL_",
    "OPENBLAS_", "GOTO", "BLIS_", "HIP_", "HSA_", "ROCM", "MASTER_", "TORCHELASTIC_",
)
_READ_AT_START_NAMES = frozenset({
    "LANG", "LANGUAGE", "TZ", "TMPDIR", "TMP", "TEMP", "RANK", "LOCAL_RANK", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME",
    "ROLE_WORLD_SIZE",
})


def read_at_start(name: str) -> bool:
    """True if a started rank may already have read ``name`` (so a change needs new ranks)."""
    return name in _READ_AT_START_NAMES or name.startswith(_READ_AT_START_PREFIXES)


ALLOCATION_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "PMI", "PMIX_")
"""Variables a kernel inherits when it runs inside a SLURM allocation (a Jupyter server
on a compute node). Passed on, they describe that allocation, not the new job or the
local ranks: sbatch refuses contradictions (``SLURM_MEM_PER_CPU`` beside ``--mem``),
srun binds to the old CPUs (``SLURM_CPU_BIND``), and frameworks that look for SLURM
(Lightning, on ``SLURM_NTASKS``) take local ranks for a SLURM job."""
PASSED_ON = ("SLURM_CONF",)
"""Allocation variables passed on all the same: where the cluster's configuration is
(the same for every job)."""


def without_allocation(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the enclosing SLURM allocation's variables (see
    ``ALLOCATION_PREFIXES``)."""
    return {name: value for name, value in env.items()
            if name in PASSED_ON or not name.startswith(ALLOCATION_PREFIXES)}


_kernel_env: tuple[dict[bytes, bytes], dict[str, str]] | None = None
"""The environment as last read (its raw bytes), and ``without_allocation`` of it."""


def _kernel_environment() -> dict[str, str]:
    """``without_allocation(os.environ)``, read again only if the environment changed: a
    session asks before every run, and decoding every variable each time is a tenth of
    a trivial run's time where comparing the raw bytes is a microsecond."""
    global _kernel_env
    raw = getattr(os.environ, "_data", None)  # (CPython's bytes behind os.environ)
    if not isinstance(raw, dict):
        return without_allocation(dict(os.environ))
    known = _kernel_env
    if known is None or known[0] != raw:
        known = _kernel_env = (dict(raw), without_allocation(dict(os.environ)))
    return dict(known[1])


def rank_environment(config: RunConfig) -> dict[str, str]:
    """The kernel's environment, made right for ranks that are not a notebook (and not
    part of the allocation the kernel may run in); ``config.env`` has the last word."""
    env = _kernel_environment()
    if env.get("MPLBACKEND", "").startswith("module://matplotlib_inline"):
        del env["MPLBACKEND"]  # ipykernel's inline backend has no kernel in a rank
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + path if path else "")
    if config.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = config.cuda_visible_devices
    env.update(config.env or {})
    return env


@dataclass(frozen=True)
class Handover:
    """What ranks started for one shape change to run a launch of another."""

    cwd: str | None = None
    """The notebook's working directory, if the ranks started in another one."""
    env: dict[str, str | None] = field(default_factory=dict)
    """Environment variables to set (None: to unset)."""


@dataclass(frozen=True)
class GroupShape:
    """Everything that makes two rank groups interchangeable, or not."""

    python: str
    nprocs: int
    cuda_visible_devices: str | None
    gpus: int
    """GPUs the ranks would see (NVML's count: the kernel creates no CUDA context)."""
    backend: str | None
    init: bool
    env: Mapping[str, str]
    cwd: str
    max_restarts: int = 0

    @classmethod
    def of(cls, config: RunConfig) -> GroupShape:
        """The shape a launch with ``config`` gets if it starts its ranks now."""
        env = rank_environment(config)
        return cls(sys.executable, config.nprocs, config.cuda_visible_devices,
                   visible_gpu_count(env.get("CUDA_VISIBLE_DEVICES")), config.backend,
                   config.init, env, os.getcwd(), config.max_restarts)

    @property
    def prepare(self) -> str | None:
        """What the ranks may set up before their Start: the gloo group, when the run
        will use gloo. An NCCL group waits for Start (no GPU is touched while idle)."""
        gloo = self.backend == "gloo" or (self.backend is None and self.gpus == 0)
        return "gloo" if self.init and gloo else None

    def handover(self, wanted: GroupShape) -> Handover | None:
        """How ranks started for this shape become ranks for ``wanted``; None if only
        new ranks can be that (a cold start)."""
        fixed = ("python", "nprocs", "cuda_visible_devices", "gpus", "backend", "init",
                 "max_restarts")
        if any(getattr(self, name) != getattr(wanted, name) for name in fixed):
            return None
        handover, left_out = self.take_up(wanted)
        return None if left_out else handover

    def unknown(self) -> GroupShape:
        """This shape for ranks whose directory and environment this kernel does not know
        (it attached to them: they started for another kernel, and took up what that
        one's cells sent): the first hand-over gives them all of this kernel's, as a
        fresh start would, but what they read when they started."""
        return dataclasses.replace(self, cwd="", env={
            name: value for name, value in self.env.items() if read_at_start(name)})

    def take_up(self, wanted: GroupShape) -> tuple[Handover, list[str]]:
        """What ranks started for this shape can take up of ``wanted``'s directory and
        environment (a session's ranks run on), and the variables they cannot."""
        changed = {} if self.env == wanted.env else {  # (the same, nearly always: at C speed)
            name: wanted.env.get(name) for name in self.env.keys() | wanted.env.keys()
            if self.env.get(name) != wanted.env.get(name)}
        left_out = sorted(name for name in changed if read_at_start(name))
        env = {name: value for name, value in changed.items() if name not in left_out}
        return Handover(wanted.cwd if wanted.cwd != self.cwd else None, env), left_out
