"""The options of a run: one frozen dataclass, checked once, before anything starts.

``RunOptions`` is the one place for each run option's name, default, check and help:
``launch``, ``Session`` and ``export`` spell the options out in their signatures (for
users, IDEs and ``launch``'s overloads; ``tests/test_options.py`` pins those to the
fields) and build a ``RunOptions`` in one call, and the magics make their flags from the
fields' ``Flag`` metadata. ``RunOptions.on_this_machine()`` counts the ranks and picks
their GPUs (``devices`` checks them): a ``RunConfig``, what the rest of nbddp runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from .._wire.messages import RankOptions
from .._wire.relay_tree import RelayTree, uses_tree
from .devices import check_ranks_fit, select_gpus, visible_gpu_count
from .flags import flag, no_flag

#: Ranks started when no GPU is visible and ``nprocs`` is not given: two ranks are the
#: fewest that exercise the distributed code paths (all-reduce, sharded samplers).
CPU_DEFAULT_NPROCS = 2

Output = Literal["rank0", "all", "none"]
OUTPUT_CHOICES: tuple[str, ...] = get_args(Output)
#: Two minutes without a line of output or a step from any rank: long enough for a slow
#: first batch or a compile, short enough to notice a hang while waiting for it.
DEFAULT_STALL_AFTER = 120.0


def _gpus_from_text(text: str) -> int | list[int]:
    """``--gpus``: ``"2"``, two GPUs; ``"0,2"`` (or ``"1,"``), those GPUs."""
    try:
        if "," in text:
            return [int(part) for part in text.split(",") if part.strip()]
        return int(text)
    except ValueError:
        raise ValueError(f"--gpus takes a count (2) or GPU indices (0,2), not {text!r}") from None


def _never_if_zero(seconds: float) -> float | None:
    """``--stall-after 0``: never say the run looks stalled."""
    return seconds or None


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """A run's options as the user gives them (to ``launch``, ``Session`` or a magic).

    The fields are in the order of ``%%ddp``'s help; ``launch``'s signature has the same
    names and defaults.
    """

    gpus: int | Sequence[int] | None = field(default=None, metadata=flag(
        "one rank per GPU: a count (--gpus 2) or GPU indices (--gpus 0,2)",
        metavar="N|I,J", value=_gpus_from_text, session="one rank per GPU (as %%ddp --gpus)"))
    """One rank per GPU: a count, or the indices of the GPUs to use."""
    nprocs: int | None = field(default=None, metadata=flag(
        "N ranks on whatever devices exist (gloo on CPU); default: one per visible GPU, or "
        f"{CPU_DEFAULT_NPROCS} on a machine without one",
        type=int, metavar="N", session="N ranks (as %%ddp --nprocs)"))
    """Number of ranks (processes) on this machine; None: one per visible GPU (or per
    GPU of ``gpus``), ``CPU_DEFAULT_NPROCS`` on a machine without one."""
    backend: str | None = field(default=None, metadata=flag(
        "process-group backend (default: nccl on GPU, gloo on CPU)",
        session="process-group backend (default: nccl on GPU, gloo on CPU)"))
    """Process-group backend; ``None`` picks NCCL on a GPU rank, gloo otherwise."""
    timeout: float | None = field(default=None, metadata=flag(
        "stop every rank and raise TimeoutError after this many seconds",
        type=float, metavar="SECONDS",
        session="default time limit of each cell (%%ddp --timeout overrides it)"))
    """Seconds the whole run may take before every rank is stopped."""
    init: bool = field(default=True, metadata=flag(
        "do not initialise the default process group (your code does)",
        name="--no-init", action="store_false",
        session="do not initialise the default process group (your cells do)"))
    """Initialise (and destroy) the default process group around the user's function."""
    max_restarts: int = field(default=0, metadata=flag(
        "when a rank fails, torchrun restarts every rank, up to N times (the cell runs "
        "again from its start)", type=int, metavar="N"))
    """How many times torchrun restarts every rank after one fails (``--max-restarts``)."""
    stall_after: float | None = field(default=DEFAULT_STALL_AFTER, metadata=flag(
        "say the run looks stalled when no rank has printed or advanced for this long "
        f"(default {DEFAULT_STALL_AFTER:g}; 0: never)",
        type=float, metavar="SECONDS", value=_never_if_zero))
    """Seconds without output or progress from any rank after which the panel says the
    run looks stalled; None never says it."""
    pdb: bool = field(default=False, metadata=flag(
        "when a rank raises, open pdb in the notebook at the failing frame, with its "
        "variables, before the ranks are stopped (as %%pdb on does; q ends it)",
        action="store_true"))
    """Post-mortem: when a rank raises, pdb opens in the notebook at the failing frame of
    that rank before the ranks are stopped; ``q`` ends it and the error is raised."""
    output: Output = field(default="rank0", metadata=flag(
        "show every rank's output live, each line prefixed with its rank",
        name="--all-ranks", action="store_const", const="all"))
    """Whose output is shown live: ``"rank0"``, ``"all"`` (each line prefixed), or
    ``"none"``: nothing at all, no panel or summary line either (the records keep it)."""
    all_ranks: bool = field(default=False, metadata=no_flag(
        "a cell's value is rank 0's; every rank's output is --all-ranks (output)"))
    """Return every rank's value, in rank order, instead of rank 0's."""
    env: Mapping[str, str] | None = field(default=None, metadata=no_flag(
        "a cell's ranks get the kernel's environment"))
    """Extra environment variables for every rank (a ``dict`` once checked, never None)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", dict(self.env or {}))
        if self.nprocs is not None:
            if isinstance(self.nprocs, bool) or not isinstance(self.nprocs, int):
                raise TypeError(f"nprocs must be an int, got {self.nprocs!r}")
            if self.nprocs < 1:
                raise ValueError(f"nprocs must be at least 1, got {self.nprocs}")
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            raise ValueError(
                f"backend must be a name such as 'nccl' or 'gloo', got {self.backend!r}")
        if self.timeout is not None and not (
            isinstance(self.timeout, (int, float)) and self.timeout > 0
        ):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        check_max_restarts(self.max_restarts)
        self._check_stall_after()
        if self.output not in OUTPUT_CHOICES:
            raise ValueError(f"output must be one of {OUTPUT_CHOICES}, got {self.output!r}")
        bad_env = [k for k, v in (self.env or {}).items()
                   if not (isinstance(k, str) and isinstance(v, str))]
        if bad_env:
            raise TypeError(f"env must map str to str; bad entries: {bad_env}")

    def _check_stall_after(self) -> None:
        if self.stall_after is not None and (
                isinstance(self.stall_after, bool) or not isinstance(self.stall_after, (int, float))
                or self.stall_after <= 0):
            raise ValueError(f"stall_after must be a positive number of seconds or None, got "
                             f"{self.stall_after!r}")

    def on_this_machine(self) -> RunConfig:
        """The run on this machine: ``nprocs``/``gpus`` made a rank count and a device
        selection, checked against the GPUs that are visible."""
        available = visible_gpu_count()
        if self.gpus is not None:
            devices = select_gpus(self.gpus, available)
            if self.nprocs is not None and self.nprocs != len(devices):
                raise ValueError(f"nprocs={self.nprocs} disagrees with gpus={self.gpus!r} "
                                 f"({len(devices)} GPUs); give one or the other")
            return self.config(len(devices), cuda_visible_devices=",".join(devices))
        nprocs = self.nprocs
        if nprocs is None:
            nprocs = available if available and self.backend != "gloo" else CPU_DEFAULT_NPROCS
        check_ranks_fit(nprocs, self.backend, available)
        return self.config(nprocs)

    def per_node(self, cluster: str) -> tuple[int, int]:
        """On a cluster (``cluster``: ``slurm``, ``ray``), ``nprocs`` or ``gpus`` count
        ranks per node (``gpus``: the nodes' GPUs, not this machine's): the ranks per
        node (one if neither is given) and the GPUs per node (0: none asked)."""
        nprocs, gpus = self.nprocs, self.gpus
        if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int)
                                 or gpus < 1):
            raise ValueError(f"with {cluster}, gpus is a count of GPUs per node, got "
                             f"{gpus!r}")
        if nprocs is not None and gpus is not None and nprocs != gpus:
            raise ValueError(f"nprocs={nprocs} disagrees with gpus={gpus} (ranks per node)")
        return nprocs or gpus or 1, gpus or 0

    def config(self, nprocs: int, **resolved: Any) -> RunConfig:
        """These options as a run's ``RunConfig`` of ``nprocs`` ranks in all, with what was
        resolved (``cuda_visible_devices``, a cluster job's ``max_restarts``)."""
        given = {option.name: getattr(self, option.name) for option in fields(RunOptions)}
        return RunConfig(**{**given, "nprocs": nprocs, **resolved})


@dataclass(frozen=True, kw_only=True)
class RunConfig(RunOptions):
    """What to start and how: the options with the ranks counted and their GPUs chosen
    (``RunOptions.on_this_machine``, or a SLURM job's shape)."""

    nprocs: int
    """Number of ranks (processes) in all."""
    cuda_visible_devices: str | None = None
    """``CUDA_VISIBLE_DEVICES`` for the ranks, when the user picked GPUs."""
    ranks: tuple[int, ...] | None = None
    """The ranks a session's run is given to (``--ranks``); None: every rank."""
    autoreload: bool = False
    """A session's ranks reload the user's edited modules before the run."""

    @property
    def rank_options(self) -> RankOptions:
        """What each rank is told with the run's ``Start``."""
        return RankOptions(self.init, self.backend, self.all_ranks, self.pdb, self.ranks,
                           self.autoreload)

    @property
    def running_ranks(self) -> list[int]:
        """The ranks that run the code, in order (the first one's value is the run's)."""
        return list(self.ranks) if self.ranks is not None else list(range(self.nprocs))

    @property
    def resting_ranks(self) -> list[int]:
        """A session's ranks left at rest by a run given to some ranks only."""
        if self.ranks is None:
            return []  # (every rank runs it: no set of thousands of ranks per cell)
        return sorted(set(range(self.nprocs)) - set(self.ranks))


class ConfigPerRun:
    """A session's config for each of its runs: the session's own with the run's settings
    (``dataclasses.replace``, which checks them). A run with the very same settings as
    the last, on the same config with the same ``env``, gets the last one's again: a
    session's cells mostly have the same, and each check costs the quick cell time."""

    def __init__(self) -> None:
        self._last: tuple[RunConfig, list[tuple[str, type, Any]], RunConfig] | None = None

    def for_run(self, config: RunConfig, **settings: Any) -> RunConfig:
        typed = [(name, type(value), value) for name, value in settings.items()]  # (1, True)
        last = self._last
        if last is None or last[0] is not config or last[1] != typed \
                or last[2].env != config.env:  # (a dict: it may have been changed in place)
            last = self._last = (config, typed, dataclasses.replace(config, **settings))
        return last[2]


def check_max_restarts(value: object) -> None:
    """``max_restarts`` is a count: an int, 0 or more."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_restarts must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"max_restarts must be 0 or more, got {value}")


RELAY_FROM_PER_NODE = 4
"""A cluster session's node speaks to the kernel through a relay (``_rank.relay``) once
it has this many ranks: one connection, one Start and one batch of reports per node, not
per rank. Measured on four Ray nodes (``benchmarks/bench_scale.py --without-relay``): at 2
ranks a node the relay saved the kernel no CPU and cost a hop; from 4 it saves CPU per
cell, and most of the kernel's CPU while ranks log metrics."""


def relay_option(nprocs_per_node: int, nodes: int = 1) -> list[str]:
    """nbddp's torchrun options for each of ``nodes`` cluster nodes of ``nprocs_per_node``
    ranks: a relay per node, and from ``TREE_FROM`` nodes, a tree of relays."""
    if nprocs_per_node < RELAY_FROM_PER_NODE:
        return []
    return ["--relay", "--relay-tree"] if uses_tree(nodes) else ["--relay"]


def relay_tree(nprocs_per_node: int, nodes: int) -> RelayTree | None:
    """The kernel's side of the tree of relays, where ``relay_option`` forms one."""
    if nprocs_per_node < RELAY_FROM_PER_NODE or not uses_tree(nodes):
        return None
    return RelayTree(nodes)


RESTART_SAFE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""For torchrun when it may restart the ranks. By default its workers share the
rendezvous store, where a restarted attempt reads the failed attempt's addresses and
cannot connect (pytorch/pytorch#135712); a store of their own per attempt avoids that,
for nbddp's process group and for one a user's code creates."""


def torchrun_environment(max_restarts: int) -> dict[str, str]:
    """What torchrun's environment needs for ``max_restarts``."""
    return dict(RESTART_SAFE_ENV) if max_restarts else {}


class ClusterOptions:
    """What a user gives as ``cluster=``: the option type of a cluster kind (``Slurm``,
    ``Ray``) derives from it, so that the public signatures name one type."""

    __slots__ = ()
