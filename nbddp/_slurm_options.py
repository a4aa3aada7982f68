"""What a SLURM job asks for: the user's ``Slurm`` choices and the ``#SBATCH`` options.

``Slurm`` is what a user passes to ``launch(slurm=...)``; ``SlurmOptions`` is the full
set of ``#SBATCH`` choices that export and submission write (``Slurm.options`` adds the
ranks and GPUs per node that ``launch`` decides).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ._config import check_max_restarts


@dataclass(frozen=True)
class SlurmOptions:
    """The ``#SBATCH`` choices for an exported job."""

    nodes: int = 1
    """Machines; one torchrun per machine."""
    nprocs_per_node: int = 1
    """Ranks per machine (one per GPU on GPU nodes)."""
    gpus_per_node: int = 0
    """GPUs to request per machine (0 for CPU jobs)."""
    cpus_per_task: int | None = None
    """CPUs for each machine's torchrun and its ranks."""
    time: str | None = None
    """Wall-clock limit, e.g. ``"01:00:00"``."""
    partition: str | None = None
    """The SLURM partition to submit to."""
    extra: tuple[str, ...] = ()
    """More ``#SBATCH`` lines, without the prefix, e.g. ``("--account=proj",)``."""
    port: int = 29500
    """The c10d rendezvous port on the first node."""
    max_restarts: int = 0
    """torchrun's restarts of every rank after one fails (``--max-restarts``)."""


@dataclass(frozen=True)
class Slurm:
    """Submit the run as a SLURM batch job: ``launch(fn, nprocs=2, slurm=Slurm(nodes=2))``.

    ``nprocs`` (or ``gpus``) given to ``launch`` counts ranks per node. ``sbatch`` adds
    ``#SBATCH`` lines such as ``"--account=proj"``. The run folder (payload, logs,
    metrics) must be on a filesystem the nodes share: ``$NBDDP_RUNS_DIR``, by default
    ``~/.cache/nbddp/runs``.
    """

    nodes: int = 1
    """Machines; one torchrun per machine, joined by c10d rendezvous."""
    time: str | None = None
    """The job's time limit, e.g. ``"01:00:00"``."""
    partition: str | None = None
    """The partition to submit to (the cluster's default if not given)."""
    cpus_per_task: int | None = None
    """CPUs for each machine's torchrun and its ranks."""
    sbatch: Sequence[str] = field(default=())
    """More ``#SBATCH`` options, each one line without the prefix."""
    max_restarts: int = 0
    """torchrun's restarts of every rank after one fails (as ``launch(max_restarts=)``)."""

    def __post_init__(self) -> None:
        check_max_restarts(self.max_restarts)
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"Slurm(nodes=...) must be a positive int, got {self.nodes!r}")
        if self.cpus_per_task is not None and (
                isinstance(self.cpus_per_task, bool) or not isinstance(self.cpus_per_task, int)
                or self.cpus_per_task < 1):
            raise ValueError(f"Slurm(cpus_per_task=...) must be a positive int, got "
                             f"{self.cpus_per_task!r}")
        if isinstance(self.sbatch, str) or not all(isinstance(s, str) for s in self.sbatch):
            raise TypeError(f"Slurm(sbatch=...) takes a list of lines, got {self.sbatch!r}")
        object.__setattr__(self, "sbatch", tuple(self.sbatch))

    def options(self, nprocs_per_node: int, gpus_per_node: int) -> SlurmOptions:
        return SlurmOptions(nodes=self.nodes, nprocs_per_node=nprocs_per_node,
                            gpus_per_node=gpus_per_node, cpus_per_task=self.cpus_per_task,
                            time=self.time, partition=self.partition, extra=tuple(self.sbatch),
                            max_restarts=self.max_restarts)
