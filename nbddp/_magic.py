"""``%%ddp`` and ``%ddp_session``: thin adapters over ``launch`` and ``Session``.

``%%ddp`` parses the options, turns the cell into a ``Cell`` (the notebook names it
reads go along), runs it (on the open session's ranks, or a fresh group through
``launch``) and binds the ``--out`` names in the notebook afterwards. ``%ddp_session``
starts, stops, restarts and describes the kernel's one session.
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import (
    Magics,
    line_cell_magic,
    line_magic,
    magics_class,
    output_can_be_silenced,
)
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ._errors import NbddpError
from ._export.script import export
from ._launch import launch
from ._rank.cell import Cell, CellResult
from ._run.config import DEFAULT_STALL_AFTER
from ._run.devices import visible_gpu_count
from ._session import Session
from ._slurm.options import Slurm

_CPU_HINT = "to run on the CPU, use %%ddp --nprocs N (gloo ranks) instead of --gpus"


def _parse_gpus(text: str | None) -> int | list[int] | None:
    """``"2"``: two GPUs; ``"0,2"`` (or ``"1,"``): those GPUs."""
    if text is None:
        return None
    try:
        if "," in text:
            return [int(part) for part in text.split(",") if part.strip()]
        return int(text)
    except ValueError:
        raise UsageError(f"--gpus takes a count (2) or GPU indices (0,2), not {text!r}") from None


def _check_gpus(gpus: int | list[int], typed: str) -> None:
    available = visible_gpu_count()
    wanted = gpus if isinstance(gpus, int) else max(gpus, default=-1) + 1
    if wanted > available:
        raise UsageError(f"--gpus {typed} asks for more GPUs than the {available} visible; "
                         f"{_CPU_HINT}")


def _parse_names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    bad = [name for name in names if not name.isidentifier()]
    if bad:
        raise UsageError(f"--out takes comma-separated names, and {bad} are not names")
    return names


def _stall_after(args: Any) -> float | None:
    """``--stall-after``: the default when not given; 0 never says the run is stalled."""
    if args.stall_after is None:
        return DEFAULT_STALL_AFTER
    return args.stall_after or None


def _session_conflicts(args: Any, gpus: int | list[int] | None, session: Session) -> list[str]:
    """The ``%%ddp`` options that ask for ranks other than the open session's."""
    config = session.config
    wanted = {
        "--nprocs": args.nprocs is not None and args.nprocs != config.nprocs,
        "--gpus": gpus is not None,
        "--backend": args.backend is not None and args.backend != config.backend,
        "--no-init": args.no_init and config.init,
        "--slurm": args.slurm,
        "--max-restarts": args.max_restarts != 0,
    }
    return [option for option, conflicts in wanted.items() if conflicts]


@magics_class
class DDPMagics(Magics):
    """The ``%%ddp`` cell magic and the ``%ddp_session`` line magic."""

    session: Session | None = None
    """The session ``%%ddp`` cells run on while it is open."""

    @magic_arguments()
    @argument("-h", "--help", action="store_true", help="show this help")
    @argument("--gpus", metavar="N|I,J",
              help="one rank per GPU: a count (--gpus 2) or GPU indices (--gpus 0,2)")
    @argument("--nprocs", type=int, metavar="N",
              help="N ranks on whatever devices exist (gloo on CPU); default: one per "
                   "visible GPU, or 2 on a machine without one")
    @argument("--backend", help="process-group backend (default: nccl on GPU, gloo on CPU)")
    @argument("--timeout", type=float, metavar="SECONDS",
              help="stop every rank and raise TimeoutError after this many seconds")
    @argument("--no-init", action="store_true",
              help="do not initialise the default process group (your code does)")
    @argument("--max-restarts", type=int, default=0, metavar="N",
              help="when a rank fails, torchrun restarts every rank, up to N times (the "
                   "cell runs again from its start)")
    @argument("--stall-after", type=float, metavar="SECONDS",
              help="say the run looks stalled when no rank has printed or advanced for "
                   "this long (default 120; 0: never)")
    @argument("--out", default="", metavar="NAMES",
              help="comma-separated names whose rank-0 values are bound in the notebook "
                   "after the run (a DDP model comes back as its module; tensors on CPU)")
    @argument("--all-ranks", action="store_true",
              help="show every rank's output live, each line prefixed with its rank")
    @argument("--export", metavar="PATH",
              help="do not run: write the cell as a script for torchrun/srun/python at PATH, "
                   "an sbatch file beside it (and a payload file for data without source)")
    @argument("--slurm", action="store_true",
              help="submit the cell as a SLURM batch job (sbatch) and follow it here: queue "
                   "state, output, metrics, result; interrupting the cell runs scancel")
    @argument("--nodes", type=int, default=1, metavar="N",
              help="with --slurm or --export: machines for the job (ranks per node: --nprocs "
                   "or --gpus; default one)")
    @argument("--time", help="with --slurm or --export: the job's time limit, e.g. 01:00:00")
    @argument("--partition", help="with --slurm or --export: the SLURM partition")
    @argument("--cpus-per-task", type=int, metavar="N",
              help="with --slurm or --export: CPUs per node for its torchrun and ranks")
    @argument("--sbatch", action="append", default=[], metavar="LINE",
              help="with --slurm or --export: an extra #SBATCH line, e.g. "
                   "--sbatch=--account=proj (repeatable)")
    @argument("--requeue", action="store_true",
              help="with --slurm: SLURM may requeue the job (preemption, a failed node); "
                   "the cell follows it through each requeue")
    @argument("--signal-before", type=int, metavar="SECONDS",
              help="with --slurm: nbddp.stop_requested() turns true this long before the "
                   "time limit (save, then nbddp.requeue())")
    @output_can_be_silenced  # a trailing ';' hides the result, as in any cell
    @line_cell_magic
    def ddp(self, line: str, cell: str | None = None) -> Any:
        """Run this cell on every rank of a fresh DDP process group started by torchrun.

        The cell sees the notebook names it uses (modules are imported by name on the
        ranks; functions, classes and data are sent by value). Rank 0's output is shown
        live; the value of a trailing expression on rank 0 is the cell's result; a
        failing rank raises nbddp.WorkerError with the traceback of the cell's lines.
        """
        __tracebackhide__ = True  # errors show the user's cell, not this frame
        args = parse_argstring(self.ddp, line)
        if args.help:
            print(self.ddp.parser.format_help())
            return None
        if cell is None:
            raise UsageError("%%ddp is a cell magic: put it on the first line of the cell "
                             "to run on every rank (%ddp -h lists the options)")
        gpus = _parse_gpus(args.gpus)
        if gpus is not None and not (args.export or args.slurm):  # else: the cluster's GPUs
            _check_gpus(gpus, args.gpus)
        cluster_only = (args.nodes != 1 or args.time or args.partition or args.sbatch
                        or args.cpus_per_task)
        if cluster_only and not (args.export or args.slurm):
            raise UsageError("--nodes, --time, --partition and --sbatch describe a SLURM job: "
                             "add --slurm to submit the cell, or --export PATH to write it")
        if args.export and args.slurm:
            raise UsageError("--export writes the job's files and --slurm submits it: "
                             "choose one")
        if (args.requeue or args.signal_before is not None) and not args.slurm:
            raise UsageError("--requeue and --signal-before are for a job submitted from "
                             "the notebook: add --slurm")
        session = self.session if self.session and not self.session.closed else None
        if session is not None and not args.export:
            conflicts = _session_conflicts(args, gpus, session)
            if conflicts:
                raise UsageError(
                    f"{', '.join(conflicts)} would need other ranks than the open session's "
                    f"({session.config.nprocs} ranks): run the cell without them, or "
                    "%ddp_session stop first")
        try:
            code = self._cell(cell, _parse_names(args.out),
                              session.names if session is not None else ())
        except SyntaxError as exc:  # shown at the cell's line, before anything starts
            raise exc.with_traceback(None) from None
        if args.export:
            return _export_cell(code, args, gpus)
        if session is not None:
            job = session.submit(code, timeout=args.timeout,
                                 output="all" if args.all_ranks else None,
                                 stall_after=_stall_after(args))
            result = job.result()
        else:
            result = self._launch(code, args, gpus)
        self._shell.user_ns.update(result.outputs)
        return result.value

    def _launch(self, code: Cell, args: Any, gpus: int | list[int] | None) -> CellResult:
        __tracebackhide__ = True
        try:
            slurm = args.slurm and Slurm(nodes=args.nodes, time=args.time,
                                         partition=args.partition, sbatch=args.sbatch,
                                         cpus_per_task=args.cpus_per_task,
                                         requeue=args.requeue, signal_before=args.signal_before)
            return launch(code, args.nprocs, gpus=_per_node(gpus) if args.slurm else gpus,
                          backend=args.backend, timeout=args.timeout, init=not args.no_init,
                          output="all" if args.all_ranks else "rank0",
                          max_restarts=args.max_restarts, slurm=slurm,
                          stall_after=_stall_after(args))
        except (ValueError, TypeError) as exc:
            if isinstance(exc, NbddpError):
                raise
            raise UsageError(str(exc)) from None  # a bad option value, before any start

    @property
    def _shell(self) -> Any:
        assert self.shell is not None, "the magic runs inside IPython"
        return self.shell

    def _cell(self, body: str, outputs: tuple[str, ...], ranks_own: Any = ()) -> Cell:
        """The cell as the ranks run it: line 1 is the ``%%ddp`` line, as in the notebook."""
        __tracebackhide__ = True
        source = "\n" + body
        filename = self._shell.compile.cache(source, _running_cell_number(self._shell))
        return Cell.from_notebook(source, filename, self._shell.user_ns,
                                  self._shell.user_ns_hidden, outputs, ranks_own)

    @magic_arguments()
    @argument("action", nargs="?", default="status",
              choices=["start", "stop", "restart", "status"],
              help="start ranks that keep their state from cell to cell, stop or restart "
                   "them, or say what runs (the default)")
    @argument("--nprocs", type=int, metavar="N", help="N ranks (as %%ddp --nprocs)")
    @argument("--gpus", metavar="N|I,J", help="one rank per GPU (as %%ddp --gpus)")
    @argument("--backend", help="process-group backend (default: nccl on GPU, gloo on CPU)")
    @argument("--no-init", action="store_true",
              help="do not initialise the default process group (your cells do)")
    @argument("--timeout", type=float, metavar="SECONDS",
              help="default time limit of each cell (%%ddp --timeout overrides it)")
    @line_magic
    def ddp_session(self, line: str) -> Any:
        """Ranks that keep their state between ``%%ddp`` cells.

        ``%ddp_session start --nprocs 2`` starts them; from then on every ``%%ddp`` cell
        runs on them, and the names a cell assigns stay on the ranks for the next cells
        (other names come from the notebook, as always). ``%ddp_session stop`` ends the
        session, ``restart`` starts fresh ranks, and ``%ddp_session`` says what runs
        (its value is a ``SessionStatus``).
        """
        args = parse_argstring(self.ddp_session, line)
        open_session = self.session if self.session and not self.session.closed else None
        if args.action == "start":
            if open_session is not None:
                raise UsageError("a session is already open (%ddp_session stop, or restart)")
            self.session = open_session = _start_session(args)
        elif open_session is None:
            print("no session is open; start one with %ddp_session start --nprocs N")
            return None
        elif args.action == "stop":
            open_session.close()
            print("nbddp session: stopped; its ranks are gone")
            return None
        elif args.action == "restart":
            open_session.restart()
        return open_session.status()


def _running_cell_number(shell: Any) -> int:
    """The number of the cell being run (its ``In[N]``), which its traceback lines show.

    ``shell.execution_count`` is the next cell's number on IPython 9 (which counts a cell
    before running it) and this cell's on IPython 8 (after), so it is not asked directly:
    the running cell's own ``ExecutionResult`` (set while its code runs) has the number
    IPython compiled it under; outside ``run_cell`` the display hook's prompt number."""
    running = getattr(shell.displayhook, "exec_result", None)
    number = getattr(running, "execution_count", None)
    if number is not None:
        return int(number)
    return int(getattr(shell.displayhook, "prompt_count", shell.execution_count))


def _start_session(args: Any) -> Session:
    gpus = _parse_gpus(args.gpus)
    if gpus is not None:
        _check_gpus(gpus, args.gpus)
    try:
        return Session(args.nprocs, gpus=gpus, backend=args.backend, init=not args.no_init,
                       timeout=args.timeout)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, NbddpError):
            raise
        raise UsageError(str(exc)) from None


def _per_node(gpus: int | list[int] | None) -> int | None:
    """A cluster job's GPUs per node: a count (indices name this machine's GPUs)."""
    return len(gpus) if isinstance(gpus, list) else gpus


def _export_cell(code: Cell, args: Any, gpus: int | list[int] | None) -> None:
    """``--export``: write the script and sbatch file, say how to run them."""
    gpu_count = _per_node(gpus) or 0
    try:
        written = export(code, args.export, nodes=args.nodes, nprocs=args.nprocs,
                         gpus=gpu_count, time=args.time, partition=args.partition,
                         cpus_per_task=args.cpus_per_task, sbatch=args.sbatch,
                         max_restarts=args.max_restarts)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    script = written[0]
    print("wrote " + ", ".join(str(p) for p in written))
    print(f"run it with: torchrun --nproc_per_node {args.nprocs or gpu_count or 2} {script}, "
          f"python {script}, or sbatch {written[1]}")


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbddp`` registers ``%%ddp``."""
    ipython.register_magics(DDPMagics)
