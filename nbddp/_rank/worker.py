"""The entry point torchrun runs on every rank.

``python -m nbddp._worker RUN_DIR [--prepare gloo] [--mailbox | --remote [--grace S]]
[--relay-output]``

Bootstrap order matters. Output goes to a log file first, so even a crash is recorded.
Then the rank connects to the kernel, says hello, and prepares while the kernel may not
yet know what it will run: it imports torch and, with ``--prepare gloo``, joins the
default gloo process group. Then it waits for its ``Start``: a standby rank waits here
for the next launch. It creates no CUDA context and no NCCL communicator before that.

Each ``Start`` is a run (see ``_rank.loop``): a one-off run ends the rank; a session's rank
goes back to waiting, until the kernel closes the link. A SLURM job's rank
(``--mailbox``) reads its ``Start`` from the run folder and carries on if the kernel
goes (see ``_rank.link``); a SLURM session's rank (``--remote``) waits for each Start on
the kernel's TCP channel, as a local one does on its socket, and outlives its kernel for
``--grace`` seconds (by default, as long as the job runs) for another to attach (see
``_rank.attachable``); a Ray session's rank does the same, and as its node shares no
filesystem with the kernel, sends its output over the channel (``--relay-output``, see
``_rank.output_relay``). This module imports nothing of the kernel side.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import faulthandler
import io
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from .._wire.messages import Assigned, Hello, Ready, Requeueing, Result, StopRequested
from .._wire.rundir import NODE_NAME_ENV, RunDir
from .._wire.stacks import answer_stacks
from .._wire.versions import own_versions
from .attachable import AttachableLink
from .debugger import install as install_pdb
from .link import KernelLink
from .loop import Rank, failure, prepare
from .output_relay import OutputRelay
from .requeue import watch_for_stop

_PR_SET_PDEATHSIG = 1


def _redirect_output(log: Path) -> None:
    """Send this process's stdout and stderr (Python and C level) to ``log``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)
    faulthandler.enable(all_threads=False)  # a segfault still leaves a Python traceback


def _output_mover(run_dir: RunDir) -> Callable[[Path, Path], None]:
    """Moves the log to a run's records; what was written before the first run (in the
    run dir) goes along."""

    def move(old: Path, new: Path) -> None:
        if old.parent == run_dir.path:
            sys.stdout.flush()
            sys.stderr.flush()
            with contextlib.suppress(FileNotFoundError), open(old, "rb") as before:
                data = before.read()
                if data:
                    fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                    os.write(fd, data)
                    os.close(fd)
            old.unlink(missing_ok=True)  # a rank torchrun restarts must not copy it again
        _redirect_output(new)

    return move


def _die_with_launcher() -> None:
    """Ask Linux to kill this rank if torchrun dies (it starts ranks in new sessions)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def hello(rank: int, remote: bool = False) -> Hello:
    """What this rank says first: who it is, and where it runs (the node's name as its
    Ray agent or SLURM gives it: the test clusters' virtual nodes share one host); on
    another machine than the kernel's (``remote``), its versions too."""
    node = (os.environ.get(NODE_NAME_ENV) or os.environ.get("SLURMD_NODENAME")
            or socket.gethostname())
    return Hello(rank, os.getpid(), node, int(os.environ.get("LOCAL_RANK", "0")),
                 own_versions() if remote else ())


def _exit(code: int) -> None:
    """Leave without C++ static destructors (gloo can abort in them after a clean run)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve(link: KernelLink, run_dir: RunDir, rank: int, backend: str | None,
           relay: OutputRelay | None = None) -> int:
    """Prepare, then run each Start until there is no more; the exit code. ``relay``:
    the output goes to the kernel over the link (it cannot read the node's files)."""
    try:
        prepared = prepare(backend)
    except BaseException as exc:  # noqa: BLE001 - the kernel hears of it as a failure
        link.send(failure(rank, exc))
        return 1
    link.send(Ready(rank))
    me = Rank(rank, run_dir.path, run_dir.rank_log(rank), prepared,
              relay.move if relay is not None else _output_mover(run_dir), link.in_run)
    if isinstance(link, AttachableLink):  # what a kernel that attaches is told (the
        link.greeting = lambda: [hello(rank, True), *(  # names before Ready, which
            [Assigned(rank, tuple(sorted(me.scope.assigned)))] if rank == 0 else []),
            Ready(rank)]  # is what it waits for)
    while (start := link.wait_start()) is not None:  # (it marks the rank busy)
        report = me.run(start, link.send)
        if relay is not None:
            relay.flush()  # (the run's last lines before its end)
        link.send(report.message, report.data)
        link.run_over()
        me.interrupts.forget()  # (after that: a later SIGINT finds the rank at rest)
        me.at_rest(link.send, link.rests_for)
        ended_well = isinstance(report.message, (Result, Requeueing))
        del report  # (its data, a CPU copy of the result's tensors, goes now)
        if not start.session:
            return 0 if ended_well else 1
    return 0


def _link(run_dir: RunDir, rank: int, args: argparse.Namespace) -> KernelLink:
    if args.mailbox:
        return KernelLink.slurm(run_dir, rank)
    if args.remote:
        return AttachableLink.connect(run_dir, rank, args.grace)
    return KernelLink.local(run_dir, rank)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m nbddp._worker")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--prepare", choices=["gloo"])
    link_kind = parser.add_mutually_exclusive_group()
    link_kind.add_argument("--mailbox", action="store_true")
    link_kind.add_argument("--remote", action="store_true")
    parser.add_argument("--grace", type=float)
    parser.add_argument("--relay-output", action="store_true")
    args = parser.parse_args(argv)
    rank = int(os.environ["RANK"])
    run_dir = RunDir(args.run_dir, shared=args.mailbox or args.remote)
    _redirect_output(run_dir.rank_log(rank))
    answer_stacks(run_dir.stacks_file(rank))
    _die_with_launcher()
    link = _link(run_dir, rank, args)
    link.send(hello(rank, remote=args.remote or args.mailbox))
    if isinstance(link, AttachableLink):
        link.greeting = lambda: [hello(rank, True)]
    watch_for_stop(lambda: link.send(StopRequested(rank)))  # a SLURM job's time limit
    install_pdb(rank, link.ask, link.send)  # breakpoint() asks the notebook
    relay = OutputRelay(rank, run_dir.rank_log(rank), link.send) if args.relay_output \
        else None
    code = _serve(link, run_dir, rank, args.prepare, relay)
    link.close()
    _exit(code)

