"""A cluster kind that lives only in the tests: its package, and the one line that
registers it (the last one here). It shows what a new backend is: an option type whose
fields say their magic flags, and a ``ClusterKind`` that makes the backends. Its ranks
run on this machine (through the local backend), each told its kind's label in
``NBDDP_LOOPBACK``, so a test sees that the cell went through this kind and no other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from nbddp._backends import register
from nbddp._local.backend import local_backend
from nbddp._run.backend import Backend
from nbddp._run.cluster_kind import ClusterKind, ClusterShape
from nbddp._run.config import ClusterOptions, RunOptions
from nbddp._run.flags import flag, flag_values


@dataclass(frozen=True)
class Loopback(ClusterOptions):
    """Run the ranks here, through the loopback kind: ``cluster=Loopback(label="x")``."""

    label: str = field(default="here", metadata=flag(
        "with --loopback: what each rank finds in NBDDP_LOOPBACK", metavar="TEXT"))
    """What each rank finds in ``NBDDP_LOOPBACK``."""

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not self.label:
            raise ValueError(f"Loopback(label=...) is a non-empty str, got {self.label!r}")


class LoopbackKind(ClusterKind):
    """The loopback cluster, as the front door finds it: ``--loopback``."""

    name, title, options, job_word = "loopback", "Loopback", Loopback, "run"
    run_help = session_help = "run the cell on this machine, through the tests' cluster kind"

    def run_backend(self, options: RunOptions, chosen: Any) -> Backend:
        return local_backend(_labelled(options, chosen))

    def session_backend(self, options: RunOptions, chosen: Any,
                        grace: float | None) -> Backend:
        if grace is not None:
            raise ValueError("a loopback session's ranks end with the kernel: no grace")
        return local_backend(_labelled(options, chosen))

    def from_flags(self, parsed: Any, shape: ClusterShape) -> Any:
        if shape.nodes != 1:
            raise ValueError("the loopback cluster is this one machine: no --nodes")
        return Loopback(**flag_values(Loopback, parsed))


def _labelled(options: RunOptions, chosen: Loopback) -> RunOptions:
    return dataclasses.replace(options, env={**(options.env or {}), "NBDDP_LOOPBACK": chosen.label})


LOOPBACK = register(LoopbackKind())
