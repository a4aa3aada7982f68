"""The magics' cluster flags, made from the registry of cluster kinds (``_backends``).

Every registered kind gives ``%%ddp`` and ``%ddp_session start`` its word as a flag
(``--slurm``, ``--ray``) and the flags of its option type (``--time``, ``--address``...);
the magics own the flags that say the shape of any cluster's job: ``--nodes``, and a
session's ``--grace``. Here the parsed flags are checked together (one cluster; no flag
of a kind that was not chosen) and turned into the option object the front door takes
as ``cluster=``. A kind registered after the magics were made (a user's own) gets its
flags on the next magic line (``add_new_kinds``).
"""

from __future__ import annotations

import argparse
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

from ._backends import KINDS
from ._run.cluster_kind import ClusterKind, ClusterShape, flags_say

NODES = ("--nodes", {"dest": "nodes", "type": int, "default": 1, "metavar": "N",
                     "help": "with a cluster (--slurm, --ray) or --export: machines for the "
                             "job (ranks per node: --nprocs or --gpus; default one)"})
GRACE = ("--grace", {"dest": "grace", "type": float, "metavar": "SECONDS",
                     "help": "with a cluster: how long the ranks wait for a kernel to attach "
                             "after this one has gone (default with --slurm: as long as the "
                             "job runs; with --ray: they end with the kernel)"})


def cluster_arguments(session: bool = False) -> list[argument]:
    """The magic's arguments for every registered kind, and the shape flags."""
    return [argument(option, **keywords) for option, keywords in _argparse_arguments(session)]


def add_new_kinds(parser: argparse.ArgumentParser, session: bool = False) -> bool:
    """Give ``parser`` the flags of kinds registered since it was made; whether any were
    added (a cached parse of a line is then out of date). Asked at every magic line: a
    look at the registry's length, unless it grew."""
    if _KINDS_KNOWN.get(id(parser)) == len(KINDS):
        return False
    known = set(parser._option_string_actions)  # (argparse's own record of its flags)
    added = False
    for option, keywords in _argparse_arguments(session):
        if option not in known:
            parser.add_argument(option, **keywords)
            added = True
    _KINDS_KNOWN[id(parser)] = len(KINDS)
    return added


_KINDS_KNOWN: dict[int, int] = {}
"""How many kinds each magic's parser has the flags of (by the parser's id)."""


def _argparse_arguments(session: bool) -> list[tuple[str, dict[str, Any]]]:
    """``add_argument``'s arguments: each kind's word and flags (a flag that several
    kinds declare, once), then ``--nodes`` (and a session's ``--grace``)."""
    found: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        found[f"--{kind.name}"] = {"dest": kind.name, "action": "store_true",
                                   "help": kind.session_help if session else kind.run_help}
        for option, keywords in kind.flags():
            found.setdefault(option, keywords)
    found[NODES[0]] = NODES[1]
    if session:
        found[GRACE[0]] = GRACE[1]
    return list(found.items())


def chosen_kind(parsed: Any) -> ClusterKind | None:
    """The kind whose word the line gave (``--slurm``), if any; one at most."""
    chosen = [kind for kind in KINDS if getattr(parsed, kind.name, False)]
    if len(chosen) > 1:
        raise UsageError("a cell runs on one cluster: "
                         + " or ".join(f"--{kind.name}" for kind in chosen) + ", not both")
    return chosen[0] if chosen else None


def cluster_flags_given(parsed: Any, session: bool = False) -> list[str]:
    """Every cluster flag the line gave: a kind's word and flags, ``--nodes``, ``--grace``."""
    given = [f"--{kind.name}" for kind in KINDS if getattr(parsed, kind.name, False)]
    for kind in KINDS:
        given += [flag for flag in _own_flags_given(kind, parsed) if flag not in given]
    return given + _shape_flags_given(parsed, session)


def check_cluster_flags(parsed: Any, exporting: bool = False, session: bool = False) -> None:
    """The cluster flags of a parsed line, checked together: one cluster, and no flag of
    a kind that was not chosen (``UsageError`` says which, and what to add)."""
    chosen = chosen_kind(parsed)
    if chosen is None:
        _check_unchosen(parsed, exporting, session)
        return
    if exporting:
        raise UsageError(f"--export writes the job's files and --{chosen.name} runs the cell: "
                         "choose one")
    its_own = {option for option, _ in chosen.flags()}
    for kind in KINDS:
        if kind is chosen:
            continue
        others = [flag for flag in _own_flags_given(kind, parsed) if flag not in its_own]
        if others:
            raise UsageError(f"{flags_say(others, 'describe')} a {kind.title} {kind.job_word}; "
                             f"with --{chosen.name}, the flags of {chosen.title} say where "
                             f"the ranks run (%ddp -h lists them)")
    problem = chosen.check_flags(parsed, session)
    if problem:
        raise UsageError(problem)


def cluster_from_flags(parsed: Any, gpus_per_node: int | None,
                       session: bool = False) -> Any:
    """The option object the line asks for (``cluster=``), or None for this machine."""
    kind = chosen_kind(parsed)
    if kind is None:
        return None
    shape = ClusterShape(nodes=parsed.nodes, gpus_per_node=gpus_per_node,
                         grace=getattr(parsed, "grace", None) if session else None)
    return kind.from_flags(parsed, shape)


def _check_unchosen(parsed: Any, exporting: bool, session: bool) -> None:
    shape_flags = _shape_flags_given(parsed, session)
    for kind in KINDS:
        given = _own_flags_given(kind, parsed)
        if given:
            problem = kind.unchosen(given + shape_flags, exporting, session)
            if problem:
                raise UsageError(problem)
    if shape_flags and not (exporting and shape_flags == ["--nodes"]):
        words = " or ".join(f"--{kind.name}" for kind in KINDS)
        then = ("to start the session's ranks on one" if session
                else "to run the cell on one, or --export PATH to write it as a job")
        raise UsageError(f"{flags_say(shape_flags, 'ask')} for a cluster: add {words} {then}")


def _own_flags_given(kind: ClusterKind, parsed: Any) -> list[str]:
    """``kind``'s flags (not its word) whose value the line changed from the default."""
    return [option for option, keywords in kind.flags()
            if getattr(parsed, keywords["dest"], None) != keywords["default"]]


def _shape_flags_given(parsed: Any, session: bool) -> list[str]:
    given = ["--nodes"] if getattr(parsed, "nodes", 1) != 1 else []
    if session and getattr(parsed, "grace", None) is not None:
        given.append("--grace")
    return given
