"""``%%ddp`` and ``%ddp_session``: thin adapters over ``launch`` and ``Session``.

``%%ddp`` parses the options, turns the cell into a ``Cell`` (the notebook names it
reads go along), runs it (on the open session's ranks, or a fresh group through
``launch``) and binds the ``--out`` names in the notebook afterwards. ``%ddp_session``
starts, stops, restarts and describes the kernel's one session.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from IPython.core.error import UsageError
from IPython.core.magic import (
    Magics,
    line_cell_magic,
    line_magic,
    magics_class,
)
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ._backends import Slurm
from ._cluster_flags import (
    add_new_kinds,
    check_cluster_flags,
    chosen_kind,
    cluster_arguments,
    cluster_flags_given,
    cluster_from_flags,
)
from ._errors import NbddpError
from ._export.script import export
from ._launch import launch
from ._notebook import auto_cells
from ._notebook.shell import (
    running_cell_number,
    unless_hidden,
    without_ipythons_own_post_mortem,
)
from ._rank.cell import Cell, CellResult
from ._rank.debugger import debug_last_failure
from ._run.config import RunOptions
from ._run.devices import GpusNotVisible
from ._run.flags import argparse_arguments, flag_values
from ._run.session.rank_choice import parse_ranks
from ._session import Session
from ._session_switches import SWITCHES, switched

_CPU_HINT = "to run on the CPU, use %%ddp --nprocs N (gloo ranks) instead of --gpus"
F = TypeVar("F", bound=Callable[..., Any])


def _flags(options: type, session: bool = False) -> list[argument]:
    """The flags made from an options dataclass's fields (see ``_run.flags``): each
    stores its value under the field's name."""
    return [argument(name, **keywords) for name, keywords in argparse_arguments(options, session)]


def _arguments(*arguments: argument) -> Callable[[F], F]:
    """Give a magic ``arguments``, in this order (as ``@argument`` lines would)."""
    def add(magic: F) -> F:
        for each in reversed(arguments):  # the last applied comes first
            magic = each(magic)
        return magic
    return add


def _whole_flags_only(magic: F) -> F:
    """Refuse abbreviated flags (argparse takes ``--time`` for ``--timeout`` where only
    that one starts so, and a flag added later would change what an old cell means)."""
    magic.parser.allow_abbrev = False  # type: ignore[attr-defined]  # magic_arguments'
    return magic


def _values(options: type, args: Any, session: bool = False) -> dict[str, Any]:
    """The keyword arguments of ``options`` that the parsed flags give."""
    try:
        return flag_values(options, args, session)
    except ValueError as exc:  # e.g. --gpus two
        raise UsageError(str(exc)) from None


def _usage_error(exc: ValueError | TypeError, gpus: str | None) -> UsageError:
    """A bad option value that ``launch`` or ``Session`` refused, before anything started,
    in the magic's words: GPUs that are not visible are named as ``--gpus`` asked."""
    if isinstance(exc, GpusNotVisible):
        return UsageError(f"--gpus {gpus} asks for more GPUs than the {exc.available} visible; "
                          f"{_CPU_HINT}")
    return UsageError(str(exc))


def _parse_names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    bad = [name for name in names if not name.isidentifier()]
    if bad:
        raise UsageError(f"--out takes comma-separated names, and {bad} are not names")
    return names


def _check_combination(args: Any) -> None:
    """Flags that mean something only beside others: a cluster's, ``--export``'s."""
    check_cluster_flags(args, exporting=bool(args.export))
    if args.ranks is not None and args.export:
        raise UsageError("--ranks picks a session's ranks for a cell; an exported script "
                         "runs on every rank")


def _chosen_ranks(text: str, session: Session | None) -> tuple[int, ...] | None:
    """``--ranks``' ranks of the open session (a fresh group's ranks have no state to
    keep: a cell for some of them is a smaller launch)."""
    if session is None:
        raise UsageError("--ranks runs a cell on some of a session's ranks, which keep "
                         "their state: start one with %ddp_session start (for a one-off "
                         "cell, --nprocs N is the smaller run)")
    try:
        return parse_ranks(text, session.config.nprocs)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None


def _session_conflicts(run: dict[str, Any], cluster_flags: list[str],
                       session: Session) -> list[str]:
    """The ``%%ddp`` options that ask for ranks other than the open session's."""
    config = session.config
    wanted = {
        "--nprocs": run["nprocs"] is not None and run["nprocs"] != config.nprocs,
        "--gpus": run["gpus"] is not None,
        "--backend": run["backend"] is not None and run["backend"] != config.backend,
        "--no-init": not run["init"] and config.init,
        "--max-restarts": run["max_restarts"] != 0,
    }
    return [option for option, conflicts in wanted.items() if conflicts] + cluster_flags


@magics_class
class DDPMagics(Magics):
    """The ``%%ddp`` cell magic and the ``%ddp_session`` line magic."""

    session: Session | None = None
    """The session ``%%ddp`` cells run on while it is open."""

    def __init__(self, shell: Any = None, **kwargs: Any) -> None:
        super().__init__(shell, **kwargs)
        if shell is not None:
            auto_cells.install(shell, self._auto_mode)

    def _auto_mode(self) -> bool:
        session = self._open_session
        return session is not None and session.auto

    @property
    def _open_session(self) -> Session | None:
        """The session ``%%ddp`` cells run on, if one is open."""
        return self.session if self.session and not self.session.closed else None

    @_whole_flags_only
    @magic_arguments()
    @_arguments(
        argument("-h", "--help", action="store_true", help="show this help"),
        argument("--auto-cell", action="store_true", help=argparse.SUPPRESS),
        *_flags(RunOptions),
        argument("--ranks", metavar="R", help="in a session: run the cell on these ranks "
                 "only (0, 0,3, 1:); the others stay at rest with their state, and --out "
                 "and the value come from the lowest one named"),
        argument("--out", default="", metavar="NAMES",
                 help="comma-separated names whose rank-0 values are bound in the notebook "
                      "after the run (a DDP model comes back as its module; tensors on CPU)"),
        argument("--export", metavar="PATH",
                 help="do not run: write the cell as a script for torchrun/srun/python at "
                      "PATH, an sbatch file beside it (and a payload file for data without "
                      "source)"),
        *cluster_arguments(),
    )
    @line_cell_magic
    def ddp(self, line: str, cell: str | None = None) -> Any:
        """Run this cell on every rank of a fresh DDP process group started by torchrun.

        The cell sees the notebook names it uses (modules are imported by name on the
        ranks; functions, classes and data are sent by value). Rank 0's output is shown
        live; the value of a trailing expression on rank 0 is the cell's result; a
        failing rank raises nbddp.WorkerError with the traceback of the cell's lines.
        """
        __tracebackhide__ = True  # errors show the user's cell, not this frame
        if add_new_kinds(self.ddp.parser):
            _ddp_line.cache_clear()  # (lines parsed before the kind was registered)
        args, checked = _ddp_line(line)
        if checked is None:  # -h
            print(self.ddp.parser.format_help())
            return None
        if cell is None:
            raise UsageError("%%ddp is a cell magic: put it on the first line of the cell "
                             "to run on every rank (%ddp -h lists the options)")
        run: dict[str, Any] = {name: list(value) if isinstance(value, list) else value
                               for name, value in checked.items()}  # (--gpus I,J)
        if self._shell.call_pdb and not args.export:  # %pdb on: post-mortem on the rank
            run["pdb"] = True
            without_ipythons_own_post_mortem(self._shell)
        session = self._open_session
        if session is not None and not args.export:
            conflicts = _session_conflicts(run, cluster_flags_given(args), session)
            if conflicts:
                raise UsageError(
                    f"{', '.join(conflicts)} would need other ranks than the open session's "
                    f"({session.config.nprocs} ranks): run the cell without them, or "
                    "%ddp_session stop first")
        ranks = _chosen_ranks(args.ranks, session) if args.ranks is not None else None
        try:
            code = self._cell(cell, _parse_names(args.out),
                              session.names if session is not None else (),
                              magic_line=not args.auto_cell)
        except SyntaxError as exc:  # shown at the cell's line, before anything starts
            raise exc.with_traceback(None) from None
        if args.export:
            return _export_cell(code, args.export, run,
                                {**_values(Slurm, args), "nodes": args.nodes})
        if session is not None:
            result = session.call(code, timeout=run["timeout"],  # None: the session's
                                  output=None if run["output"] == "rank0" else run["output"],
                                  stall_after=run["stall_after"], pdb=run["pdb"], ranks=ranks)
        else:
            result = self._launch(code, args, run)
        self._shell.user_ns.update(result.outputs)
        return unless_hidden(result.value, cell)

    def _launch(self, code: Cell, args: Any, run: dict[str, Any]) -> CellResult:
        __tracebackhide__ = True
        try:
            if chosen_kind(args) is not None:
                run = {**run, "gpus": _per_node(run["gpus"])}
            return launch(code, **run, cluster=cluster_from_flags(args, run["gpus"]))
        except (ValueError, TypeError) as exc:
            if isinstance(exc, NbddpError):
                raise
            raise _usage_error(exc, args.gpus) from None  # a bad option value, before any start

    @property
    def _shell(self) -> Any:
        assert self.shell is not None, "the magic runs inside IPython"
        return self.shell

    def _cell(self, body: str, outputs: tuple[str, ...], ranks_own: Any = (),
              magic_line: bool = True) -> Cell:
        """The cell as the ranks run it: line 1 is the ``%%ddp`` line, as in the notebook
        (in auto mode the notebook's cell has none: its own first line is line 1)."""
        __tracebackhide__ = True
        source = "\n" + body if magic_line else body
        filename = self._shell.compile.cache(source, running_cell_number(self._shell))
        return Cell.from_notebook(source, filename, self._shell.user_ns,
                                  self._shell.user_ns_hidden, outputs, ranks_own)

    @_whole_flags_only
    @magic_arguments()
    @argument("action", nargs="?", default="status",
              choices=["start", "stop", "restart", "status", "attach", "auto", "autoreload",
                       "snapshots"],
              help="start ranks that keep their state from cell to cell, stop or restart "
                   "them, say what runs (the default), attach to a session's SLURM job "
                   "after a kernel restart, turn auto mode on or off (every cell runs on "
                   "the ranks, as if it began with %%%%ddp), autoreload on or off (the "
                   "ranks reload your edited modules before each cell; default: as the "
                   "notebook's %%%%autoreload 2), or snapshots on or off (fresh ranks that "
                   "replace lost ones get the names back)")
    @argument("job", nargs="?", metavar="JOBID|on|off",
              help="with attach: the session's SLURM job or Ray session id (default: "
                   "your one running session); with auto, autoreload or snapshots: on or "
                   "off")
    @argument("--snapshots", action="store_true",
              help="with start: keep the ranks' names after each cell that ends well, so "
                   "that fresh ranks replacing lost ones load them back")
    @argument("--snapshot-max", metavar="SIZE",
              help="with --snapshots or snapshots on: at most this much for all ranks' "
                   "snapshots, e.g. 8GiB (default: a quarter of the memory free)")
    @_arguments(
        *_flags(RunOptions, session=True),
        *cluster_arguments(session=True),
    )
    @line_magic
    def ddp_session(self, line: str) -> Any:
        """Ranks that keep their state between ``%%ddp`` cells.

        ``%ddp_session start --nprocs 2`` starts them; from then on every ``%%ddp`` cell
        runs on them, and the names a cell assigns stay on the ranks for the next cells
        (other names come from the notebook, as always). ``%ddp_session start --slurm
        --nodes 2`` starts them on a cluster's nodes, as one SLURM job, which outlives the
        kernel: ``%ddp_session attach [JOBID]`` in a new kernel reconnects to its ranks.
        ``%ddp_session start --ray --nodes 2`` starts them on a Ray cluster's nodes (with
        ``--grace SECONDS`` they outlive the kernel that long, for ``attach``).
        ``%ddp_session stop`` ends the session (and its job), ``restart`` starts fresh
        ranks, and ``%ddp_session`` says what runs (its value is a ``SessionStatus``).
        """
        add_new_kinds(self.ddp_session.parser, session=True)
        args = parse_argstring(self.ddp_session, line)
        given = cluster_flags_given(args, session=True)
        if args.action != "start" and given:
            raise UsageError(f"{', '.join(given)}: a cluster's flags are for "
                             "%ddp_session start")
        if args.snapshot_max and args.action not in ("start", "snapshots"):
            raise UsageError("--snapshot-max caps snapshots: with start --snapshots, or "
                             "snapshots on")
        if args.action in SWITCHES:
            return switched(self._open_session, args.action, args.job, args.snapshot_max)
        if args.snapshots and args.action != "start":
            raise UsageError("--snapshots is for %ddp_session start (or: %ddp_session "
                             "snapshots on)")
        if args.snapshot_max and not args.snapshots:
            raise UsageError("--snapshot-max caps snapshots: with --snapshots")
        if args.job is not None and args.action != "attach":
            raise UsageError(f"%ddp_session {args.action} takes no job id (attach does)")
        open_session = self._open_session
        if args.action in ("start", "attach") and open_session is not None:
            raise UsageError("a session is already open (%ddp_session stop, or restart)")
        if args.action == "start":
            self.session = open_session = _start_session(args)
        elif args.action == "attach":
            if _values(RunOptions, args, session=True) != _values(RunOptions, parse_argstring(
                    self.ddp_session, "attach"), session=True):
                raise UsageError("attach takes the session as it was started: no options "
                                 "but the job id")
            self.session = open_session = Session.attach(args.job)
        elif open_session is None:
            print("no session is open; start one with %ddp_session start --nprocs N")
            return None
        elif args.action == "stop":
            open_session.close()
            print("nbddp session: stopped; its ranks are gone" + (
                " (auto mode is off: cells run in the notebook)" if open_session.auto else ""))
            return None
        elif args.action == "restart":
            open_session.restart()
        return open_session.status()

    @line_magic
    def ddp_debug(self, line: str) -> None:
        """pdb on the session's rank whose error ended the last ``%%ddp`` cell, at the
        failing frame, with its variables (as ``%debug`` does for the notebook's own
        errors); ``q`` ends it. The ranks keep a failure until their next cell."""
        if line.strip():
            raise UsageError("%ddp_debug takes no arguments")
        session = self._open_session
        if session is None:
            raise UsageError("%ddp_debug looks at a session's ranks, which keep their state "
                             "after a failure; a one-off cell's ranks are gone: run it again "
                             "with %%ddp --pdb to debug where it fails")
        kept = session.submit(debug_last_failure, all_ranks=True, stall_after=None).result()
        if not any(kept):
            print(NOTHING_TO_DEBUG)


NOTHING_TO_DEBUG = ("nbddp: no rank of the session kept a failure: %ddp_debug opens pdb "
                    "where the last %%ddp cell failed, before another cell runs")


LINES_KEPT = 64
"""Distinct ``%%ddp`` lines whose parse is kept: a notebook's cells repeat a few."""


@functools.lru_cache(maxsize=LINES_KEPT)
def _ddp_line(line: str) -> tuple[Any, Mapping[str, Any] | None]:
    """``%%ddp``'s ``line`` parsed: its flags, and unless it asks for help (None), the
    run options they give, checked together. Each distinct line is parsed once (argparse
    takes a tenth of a quick session cell's kernel time); a line it refuses, every time.
    Its users change neither (they copy the options)."""
    args = parse_argstring(DDPMagics.ddp, line)
    if args.help:
        return args, None
    run = _values(RunOptions, args)
    _check_combination(args)
    return args, MappingProxyType(run)


def _start_session(args: Any) -> Session:
    check_cluster_flags(args, session=True)
    run = _values(RunOptions, args, session=True)
    try:
        snapshots = (args.snapshot_max or True) if args.snapshots else False
        if chosen_kind(args) is None:
            return Session(**run, snapshots=snapshots)
        run = {**run, "gpus": _per_node(run["gpus"])}
        cluster = cluster_from_flags(args, run["gpus"], session=True)
        return Session(**run, cluster=cluster, grace=args.grace, snapshots=snapshots)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, NbddpError):
            raise
        raise _usage_error(exc, args.gpus) from None


def _per_node(gpus: int | list[int] | None) -> int | None:
    """A cluster job's GPUs per node: a count (indices name this machine's GPUs)."""
    return len(gpus) if isinstance(gpus, list) else gpus


def _export_cell(code: Cell, path: str, run: dict[str, Any], job: dict[str, Any]) -> None:
    """``--export``: write the script and sbatch file, say how to run them."""
    gpu_count = _per_node(run["gpus"]) or 0
    try:
        written = export(code, path, nodes=job["nodes"], nprocs=run["nprocs"], gpus=gpu_count,
                         time=job["time"], partition=job["partition"],
                         cpus_per_task=job["cpus_per_task"], sbatch=job["sbatch"],
                         max_restarts=run["max_restarts"])
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    script = written[0]
    print("wrote " + ", ".join(str(p) for p in written))
    print(f"run it with: torchrun --nproc_per_node {run['nprocs'] or gpu_count or 2} {script}, "
          f"python {script}, or sbatch {written[1]}")


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbddp`` registers ``%%ddp``."""
    ipython.register_magics(DDPMagics)
