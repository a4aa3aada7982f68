"""The entry point torchrun runs on every rank: ``python -m nbddp._worker RUN_DIR RECORDS``.

Bootstrap order matters: output goes to the rank's log file first (so even a crash
is recorded), then the rank connects to the kernel, loads the payload, sets up the
process group, runs the user's function and reports its result or its exception.
A local rank stops when the kernel goes. A SLURM job's rank (``--mailbox``) carries on:
it writes every message to its mailbox file as well, and uses the kernel's TCP channel
only while it can reach it.
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

from ._channel import ChannelClient, Failure, Hello, Result, Sequenced
from ._mailbox import MailboxWriter, mailbox_path
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


class _Link:
    """Where this rank's messages go: the kernel's socket and/or the mailbox file. Each
    message is numbered, so the kernel keeps one copy of what arrives both ways."""

    def __init__(self, channel: ChannelClient | None, mailbox: MailboxWriter | None) -> None:
        self._channel, self._mailbox = channel, mailbox
        self._seq = 0
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        with self._lock:
            numbered = Sequenced(self._seq, message)
            self._seq += 1
            if self._mailbox is not None:
                self._mailbox.send(numbered)
            if self._channel is not None:
                try:
                    self._channel.send(numbered)
                except OSError:
                    if self._mailbox is None:
                        raise
                    self._channel = None  # the kernel went; the mailbox carries on

    def close(self) -> None:
        for end in (self._channel, self._mailbox):
            if end is not None:
                end.close()


def _reach_kernel(paths: RunDir) -> ChannelClient | None:
    """A SLURM rank's TCP connection to the kernel, or None if it cannot be reached."""
    try:
        host, port = paths.address.read_text().split()
        return ChannelClient((host, int(port)), paths.key.read_bytes())
    except (OSError, ValueError, ConnectionError) as exc:
        print(f"nbddp: cannot reach the notebook kernel ({exc}); reporting through files "
              f"in {paths.path}", file=sys.stderr)
        return None


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


def _connect(paths: RunDir, rank: int, mailbox: bool, finished: threading.Event) -> _Link:
    if mailbox:
        return _Link(_reach_kernel(paths), MailboxWriter(mailbox_path(paths.path, rank)))
    channel = ChannelClient(paths.socket, paths.key.read_bytes())
    _stop_when_kernel_goes(channel, finished)
    return _Link(channel, None)


def main(run_dir: str, records: str, mailbox: bool = False) -> None:
    paths = RunDir(Path(run_dir), Path(records))
    rank = int(os.environ["RANK"])
    _redirect_output(paths.rank_log(rank))
    _die_with_launcher()
    finished = threading.Event()
    channel = _connect(paths, rank, mailbox, finished)
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
    main(sys.argv[1], sys.argv[2], mailbox="--mailbox" in sys.argv[3:])
