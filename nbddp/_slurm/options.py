"""What a SLURM job asks for: the user's ``Slurm`` choices and the ``#SBATCH`` options.

``Slurm`` is what a user passes as ``launch(cluster=...)``, and the one place of the
``%%ddp`` flags that describe a SLURM job (``--time``...); ``SlurmOptions`` is the full
set of ``#SBATCH`` choices that export and submission write (``Slurm.options`` adds the
ranks and GPUs per node that ``launch`` decides; ``export`` builds one from its
arguments, and its checks are here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from .._run.config import ClusterOptions, RunConfig, RunOptions, check_max_restarts
from .._run.flags import flag, no_flag


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
    port: int | None = None
    """The c10d rendezvous port on the first node: None derives it from the job id
    (``rendezvous_port``), so that jobs sharing a first node do not collide; a number is
    that port for every job (e.g. the one a firewall opens), kept free by whoever chose it."""
    max_restarts: int = 0
    """torchrun's restarts of every rank after one fails (``--max-restarts``)."""
    requeue: bool = False
    """``--requeue``: SLURM may put the job back in the queue (preemption, node failure)."""
    signal_before: int | None = None
    """Seconds before the time limit at which the ranks are told to stop (submissions)."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nprocs_per_node < 1 or self.gpus_per_node < 0 or (
                self.cpus_per_task is not None and self.cpus_per_task < 1):
            raise ValueError("nodes, nprocs and cpus_per_task must be at least 1, gpus at "
                             "least 0")
        check_max_restarts(self.max_restarts)
        if self.port is not None and (isinstance(self.port, bool) or not isinstance(
                self.port, int) or not 0 < self.port < 65536):  # it goes into a shell script
            raise ValueError(f"the rendezvous port is a number from 1 to 65535, got "
                             f"{self.port!r}")


_MAX_SIGNAL_TIME = 65535  # sbatch --signal's limit
PORT_BASE, PORT_SPAN = 20000, 20000
"""A job's rendezvous port is ``PORT_BASE + job id % PORT_SPAN``: two jobs that share a
first node get different ports unless their ids are a multiple of ``PORT_SPAN`` apart."""


def rendezvous_port(port: int | None) -> str:
    """The rendezvous port as a batch script writes it: ``port`` if one was chosen, else
    computed by the script from ``$SLURM_JOB_ID`` (known only once the job runs)."""
    if port is not None:
        return str(port)
    return f"$(({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}))"


@dataclass(frozen=True)
class Slurm(ClusterOptions):
    """Submit the run as a SLURM batch job: ``launch(fn, nprocs=2, cluster=Slurm(nodes=2))``.

    ``nprocs`` (or ``gpus``) given to ``launch`` counts ranks per node. ``sbatch`` adds
    ``#SBATCH`` lines such as ``"--account=proj"``. The run folder (payload, logs,
    metrics) must be on a filesystem the nodes share: ``$NBDDP_RUNS_DIR``, by default
    ``~/.cache/nbddp/runs``.
    """

    nodes: int = field(default=1, metadata=no_flag(
        "the magics' --nodes (any cluster's, and --export's) gives it"))
    """Machines; one torchrun per machine, joined by c10d rendezvous."""
    time: str | None = field(default=None, metadata=flag(
        "with --slurm or --export: the job's time limit, e.g. 01:00:00"))
    """The job's time limit, e.g. ``"01:00:00"``."""
    partition: str | None = field(default=None, metadata=flag(
        "with --slurm or --export: the SLURM partition"))
    """The partition to submit to (the cluster's default if not given)."""
    cpus_per_task: int | None = field(default=None, metadata=flag(
        "with --slurm or --export: CPUs per node for its torchrun and ranks",
        type=int, metavar="N"))
    """CPUs for each machine's torchrun and its ranks."""
    sbatch: Sequence[str] = field(default=(), metadata=flag(
        "with --slurm or --export: an extra #SBATCH line, e.g. --sbatch=--account=proj "
        "(repeatable)", action="append", metavar="LINE"))
    """More ``#SBATCH`` options, each one line without the prefix."""
    max_restarts: int = field(default=0, metadata=no_flag(
        "%%ddp --max-restarts (a run option) gives it"))
    """torchrun's restarts of every rank after one fails (as ``launch(max_restarts=)``)."""
    requeue: bool = field(default=False, metadata=flag(
        "with --slurm: SLURM may requeue the job (preemption, a failed node); the cell "
        "follows it through each requeue", action="store_true"))
    """Let SLURM put the job back in the queue (``--requeue``), e.g. when it is preempted;
    the notebook follows it through each requeue. Without it the cluster's default holds."""
    signal_before: int | None = field(default=None, metadata=flag(
        "with --slurm: nbddp.stop_requested() turns true this long before the time limit "
        "(save, then nbddp.requeue())", type=int, metavar="SECONDS"))
    """Seconds before the time limit at which ``nbddp.stop_requested()`` turns true on
    every rank (SLURM may signal up to a minute earlier). Save, then ``nbddp.requeue()``."""

    def __post_init__(self) -> None:
        check_max_restarts(self.max_restarts)
        if not isinstance(self.requeue, bool):
            raise TypeError(f"Slurm(requeue=...) is True or False, got {self.requeue!r}")
        if self.signal_before is not None and (
                isinstance(self.signal_before, bool) or not isinstance(self.signal_before, int)
                or not 0 < self.signal_before <= _MAX_SIGNAL_TIME):
            raise ValueError(f"Slurm(signal_before=...) is a number of seconds from 1 to "
                             f"{_MAX_SIGNAL_TIME}, got {self.signal_before!r}")
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
                            max_restarts=self.max_restarts, requeue=self.requeue,
                            signal_before=self.signal_before)


def cluster_run(options: RunOptions, slurm: bool | Slurm) -> tuple[RunConfig, SlurmOptions]:
    """A SLURM job's shape: ``nprocs`` or ``gpus`` count ranks per node (the nodes'
    GPUs, not this machine's); default one rank per node."""
    slurm = Slurm() if slurm is True else slurm
    if not isinstance(slurm, Slurm):
        raise TypeError(f"slurm must be True or nbddp.Slurm(...), got {slurm!r}")
    per_node, gpus = options.per_node("slurm")
    restarts = options.max_restarts
    if slurm.max_restarts and restarts and slurm.max_restarts != restarts:
        raise ValueError(f"max_restarts={restarts} disagrees with Slurm(max_restarts="
                         f"{slurm.max_restarts}); give one or the other")
    restarts = slurm.max_restarts or restarts
    config = options.config(per_node * slurm.nodes, max_restarts=restarts)
    return config, dataclasses.replace(slurm, max_restarts=restarts).options(per_node, gpus)
