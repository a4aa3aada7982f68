"""The entry point torchrun runs on every rank.

``python -m nbddp._worker RUN_DIR [--prepare gloo] [--mailbox]``

Bootstrap order matters. Output goes to a log file first, so even a crash is recorded.
Then the rank connects to the kernel, says hello, and prepares while the kernel may not
yet know what it will run: it imports torch and, with ``--prepare gloo``, joins the
default gloo process group. Then it waits for its ``Start``: a standby rank waits here
for the next launch. It creates no CUDA context and no NCCL communicator before that.

With its ``Start`` the rank takes up the run: its log moves to the run's records, and it
takes up the notebook's working directory and environment. Then it loads the payload,
runs the user's function and reports its result or its exception.

A SLURM job's rank (``--mailbox``) reads its ``Start`` from the run folder and carries on
if the kernel goes (see ``_rank_link``). This module imports nothing of the kernel side.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import faulthandler
import importlib
import io
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from ._messages import Failure, Hello, RankOptions, Ready, Result, Start
from ._metrics import start_reporting
from ._payload import Payload, dumps_value
from ._rank_link import KernelLink
from ._reporter import Reporter
from ._rundir import RunDir
from ._version import __version__

_PR_SET_PDEATHSIG = 1
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


# --- the process --------------------------------------------------------------------


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


def _move_output(old: Path, new: Path) -> None:
    """Continue the log in ``new``, starting with what was written to ``old`` so far."""
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(FileNotFoundError), open(old, "rb") as before:
        data = before.read()
        if data:
            fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.write(fd, data)
            os.close(fd)
    _redirect_output(new)


def _die_with_launcher() -> None:
    """Ask Linux to kill this rank if torchrun dies (it starts ranks in new sessions)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _exit(code: int) -> None:
    """Leave without C++ static destructors (gloo can abort in them after a clean run)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# --- before Start -------------------------------------------------------------------


def _prepare(backend: str | None) -> str | None:
    """Import torch, and join the default process group if the kernel expects gloo."""
    import torch.distributed as dist

    if backend != "gloo":
        return None  # NCCL waits for Start: no CUDA context, no communicator while idle
    dist.init_process_group("gloo")
    return "gloo"


def _adopt(start: Start, run_dir: RunDir, rank: int) -> None:
    """Take up the run: the notebook's nbddp, its records, directory and environment."""
    if start.version != __version__:
        raise RuntimeError(
            f"this rank runs nbddp {__version__} ({sys.executable}), but the notebook sent "
            f"its code with nbddp {start.version}: install the same nbddp where the ranks run")
    records = Path(start.records)
    if records != run_dir.path:
        _move_output(run_dir.rank_log(rank), records / run_dir.rank_log(rank).name)
    if start.cwd is not None:
        started_in = os.getcwd()
        os.chdir(start.cwd)
        if sys.path and sys.path[0] == started_in:  # `python -m` put the old one first
            sys.path[0] = start.cwd
    for name, value in start.env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    importlib.invalidate_caches()  # modules written in the notebook since this rank started


# --- the run ------------------------------------------------------------------------


def _process_group(options: RankOptions, prepared: str | None) -> None:
    """The default process group the user's function expects, reusing a prepared one."""
    import torch
    import torch.distributed as dist

    if not options.init:
        if prepared:
            dist.destroy_process_group()
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = (options.backend != "gloo" and torch.cuda.is_available()
              and local_rank < torch.cuda.device_count())
    if on_gpu:
        torch.cuda.set_device(local_rank)
    backend = options.backend or ("nccl" if on_gpu else "gloo")
    if prepared == backend:
        return
    if prepared:
        dist.destroy_process_group()
    dist.init_process_group(backend)


def _run(payload: Payload, options: RankOptions, prepared: str | None) -> Any:
    """Call the user's function inside the default process group it expects."""
    _process_group(options, prepared)
    value = payload.fn(*payload.args, **payload.kwargs)
    if options.init:  # only after success: a failed rank reports at once
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return value


def _failure(rank: int, exc: BaseException) -> Failure:
    """Describe ``exc`` with a traceback that starts in the user's code, not in nbddp."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        pickled = dumps_value(exc)
    except Exception:
        pickled = None
    kind = type(exc)
    return Failure(rank, kind.__qualname__, kind.__module__, str(exc), text, pickled)


def _dumps_result(value: Any) -> bytes:
    try:
        return dumps_value(value)
    except Exception as exc:
        raise TypeError(f"the function's return value cannot be sent back to the notebook: "
                        f"{type(exc).__name__}: {exc}") from exc


def _serve(link: KernelLink, run_dir: RunDir, rank: int, prepare: str | None
           ) -> Result | Failure:
    """Prepare, wait for Start, run; the report for the kernel, whatever happens."""
    reporter: Reporter | None = None
    try:
        prepared = _prepare(prepare)
        link.send(Ready(rank))
        start = link.wait_start()
        _adopt(start, run_dir, rank)
        reporter = start_reporting(rank, link.send)
        payload = Payload.unpack(Path(start.payload).read_bytes())
        value = _run(payload, start.options, prepared)
        wanted = rank == 0 or start.options.all_ranks
        return Result(rank, _dumps_result(value) if wanted else None)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the kernel
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            return Result(rank, dumps_value(None) if rank == 0 else None)
        return _failure(rank, exc)
    finally:
        link.finished.set()
        if reporter is not None:
            reporter.close()  # what is still buffered goes before the report


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m nbddp._worker")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--prepare", choices=["gloo"])
    parser.add_argument("--mailbox", action="store_true")
    args = parser.parse_args(argv)
    rank = int(os.environ["RANK"])
    run_dir = RunDir(args.run_dir, shared=args.mailbox)
    _redirect_output(run_dir.rank_log(rank))
    _die_with_launcher()
    link = KernelLink.slurm(run_dir, rank) if args.mailbox else KernelLink.local(run_dir)
    link.send(Hello(rank, os.getpid()))
    report = _serve(link, run_dir, rank, args.prepare)
    link.send(report)
    link.close()
    _exit(0 if isinstance(report, Result) else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
