"""The entry point torchrun runs on every rank: ``python -m nbddp._worker RUN_DIR RECORDS``.

Bootstrap order matters: output goes to the rank's log file first (so even a crash
is recorded), then the rank connects to the kernel, loads the payload, sets up the
process group, runs the user's function and reports its result or its exception.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import io
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from ._channel import ChannelClient, Failure, Hello, Result
from ._metrics import start_reporting
from ._payload import Payload, dumps_value
from ._rundir import RunDir

_PR_SET_PDEATHSIG = 1
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _redirect_output(log: Path) -> None:
    """Send this process's stdout and stderr (Python and C level) to its log file."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)
    faulthandler.enable(all_threads=False)  # a segfault still leaves a Python traceback in the log


def _die_with_launcher() -> None:
    """Ask Linux to kill this rank if torchrun dies (it starts ranks in new sessions)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _stop_when_kernel_goes(channel: ChannelClient, finished: threading.Event) -> None:
    """If the kernel's end of the channel closes before this rank is done, stop the rank."""

    def watch() -> None:
        channel.wait_closed()
        if not finished.is_set():
            print("nbddp: the notebook kernel went away; stopping this rank", file=sys.stderr)
            os._exit(1)

    threading.Thread(target=watch, daemon=True, name="nbddp-kernel-watch").start()


def _run(payload: Payload) -> Any:
    """Call the user's function inside an initialised default process group."""
    options = payload.options
    if not options["init"]:
        return payload.fn(*payload.args, **payload.kwargs)
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = (options["backend"] != "gloo" and torch.cuda.is_available()
              and local_rank < torch.cuda.device_count())
    if on_gpu:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(options["backend"] or ("nccl" if on_gpu else "gloo"))
    value = payload.fn(*payload.args, **payload.kwargs)
    # Only after success: a failed rank reports at once, without waiting on its peers.
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


def _exit(code: int) -> None:
    """Leave without C++ static destructors (gloo can abort in them after a clean run)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(run_dir: str, records: str) -> None:
    paths = RunDir(Path(run_dir), Path(records))
    rank = int(os.environ["RANK"])
    _redirect_output(paths.rank_log(rank))
    _die_with_launcher()
    channel = ChannelClient(paths.socket, paths.key.read_bytes())
    finished = threading.Event()
    _stop_when_kernel_goes(channel, finished)
    channel.send(Hello(rank, os.getpid()))
    reporter = start_reporting(rank, channel.send)
    try:
        payload = Payload.unpack(paths.payload.read_bytes())
        value = _run(payload)
        wanted = rank == 0 or payload.options["all_ranks"]
        report: Result | Failure = Result(rank, _dumps_result(value) if wanted else None)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the kernel
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            report = Result(rank, dumps_value(None) if rank == 0 else None)
        else:
            report = _failure(rank, exc)
    finished.set()
    reporter.close()
    channel.send(report)
    channel.close()
    _exit(0 if isinstance(report, Result) else 1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
