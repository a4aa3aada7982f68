"""What a cluster backend declares, in one place, for the front door to find it.

A cluster backend (``_slurm``, ``_ray``, or one of a user's) is a package that places
rank groups (a ``Backend``, see ``_run.backend``) and one ``ClusterKind`` that says
everything the front door needs of it:

- its option type (``Slurm``, ``Ray``): what a user passes as ``launch(cluster=...)``
  and ``Session(cluster=...)``, and so how the front door knows which kind was chosen;
- its word (``slurm``): the magics' ``--slurm`` flag, and its title for messages;
- the backend of a one-off run and of a session, made from the run's options and the
  user's choices;
- its magic flags (the flagged fields of its option type, see ``_run.flags``), which of
  them only it takes, and the option object a parsed magic line gives;
- how a new kernel attaches to a session whose kernel went, and to a batch run;
- what it labels a job with (``Job.cluster_job_id``: its own id for the job).

The front door keeps one registry of kinds (``nbddp/_backends.py``); a new backend is
its package plus one ``register`` line there (or in the user's own code).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from .backend import Backend
from .config import ClusterOptions, RunOptions
from .flags import argparse_arguments, flag_values
from .groups.waiting import WaitingGroup
from .job import Job

Attached = tuple[Backend, WaitingGroup, frozenset[str]]
"""A session reconnected to a new kernel: its backend, its ranks, the names kept on them."""


@dataclass(frozen=True)
class ClusterShape:
    """What the magics' own flags say of any cluster's job: ``--nodes``, the GPUs per
    node (``--gpus``), and a session's ``--grace``."""

    nodes: int = 1
    gpus_per_node: int | None = None
    grace: float | None = None


class ClusterKind(ABC):
    """A kind of cluster the ranks may run on: its options, flags, backends, attaching."""

    name: ClassVar[str]
    """Its word: ``slurm`` (the magics' ``--slurm``; ``%ddp_session start --slurm``)."""
    title: ClassVar[str]
    """How messages name it: ``SLURM``, ``Ray``."""
    options: ClassVar[type[ClusterOptions]]
    """The option type a user gives as ``cluster=`` (a frozen dataclass whose fields say
    their magic flags, see ``_run.flags``)."""
    run_help: ClassVar[str]
    """``%%ddp --<name>``'s help line."""
    session_help: ClassVar[str]
    """``%ddp_session start --<name>``'s help line."""
    job_word: ClassVar[str] = "job"
    """What one of its runs is called in messages (a SLURM job, a Ray placement)."""

    # --- what the front door asks ----------------------------------------------------

    def chosen(self, value: Any) -> Any:
        """The user's ``cluster=`` (or ``True`` from an old ``slurm=True``) as its option
        object; ``TypeError`` for anything else."""
        if value is True:
            return self.options()
        if not isinstance(value, self.options):
            raise TypeError(f"{self.name} must be True or nbddp.{self.options.__name__}(...), "
                            f"got {value!r}")
        return value

    @abstractmethod
    def run_backend(self, options: RunOptions, chosen: Any) -> Backend:
        """The backend of a one-off run on this kind of cluster."""

    @abstractmethod
    def session_backend(self, options: RunOptions, chosen: Any,
                        grace: float | None) -> Backend:
        """The backend of a session's ranks; ``grace``: seconds they outlive the kernel
        (None: this kind's default)."""

    def attaches(self, job_id: str | int | None) -> bool:
        """Whether ``Session.attach(job_id)`` is this kind's to answer (without a job id:
        whether this account has a session of this kind that outlives its kernel)."""
        return False

    def attach_session(self, job_id: str | int | None) -> Attached:
        """The session ``job_id`` reconnected to this kernel (see ``Attached``)."""
        raise NotImplementedError(f"a session on {self.title} cannot be attached to")

    def attach_run(self, job_id: str | int, run_dir: str | os.PathLike | None) -> Job:
        """A batch run followed again from a new kernel."""
        raise NotImplementedError(f"a run on {self.title} cannot be followed again")

    # --- the magics' flags -----------------------------------------------------------

    def flags(self) -> tuple[tuple[str, dict[str, Any]], ...]:
        """``add_argument``'s arguments for each flag of the option type (``%%ddp``'s and
        ``%ddp_session start``'s alike; a flag that several kinds declare is one flag of
        the magics). Made once per option type: a session's every cell asks."""
        flags = _FLAGS.get(self.options)
        if flags is None:
            flags = _FLAGS[self.options] = tuple(argparse_arguments(self.options))
        return flags

    def from_flags(self, parsed: Any, shape: ClusterShape) -> Any:
        """The option object that a parsed magic line asks for, with the ``shape`` that
        the magics' own flags give; ``ValueError`` for a flag's text that means nothing."""
        return self.options(**flag_values(self.options, parsed))

    def unchosen(self, given: list[str], exporting: bool, session: bool) -> str | None:
        """Why this kind's flags ``given`` (option strings, ``--grace`` among them in a
        session) mean nothing without ``--<name>``; None where they do (``--export``
        writes a SLURM job's files, say)."""
        return f"{flags_say(given, 'describe')} a {self.title} {self.job_word}: add --{self.name}"

    def check_flags(self, parsed: Any, session: bool = False) -> str | None:
        """What is wrong with this kind's flags once ``--<name>`` was given (None: nothing
        the option type would not say itself)."""
        return None


_FLAGS: dict[type, tuple[tuple[str, dict[str, Any]], ...]] = {}
"""Each option type's flags, made once (an option type's fields do not change)."""


def flags_say(flags: list[str], verb: str) -> str:
    """``--a, --b describe`` (``--a describes``): flags as the subject of a message."""
    return f"{', '.join(flags)} {verb if len(flags) > 1 else verb + 's'}"
