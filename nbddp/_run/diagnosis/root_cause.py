"""Turn what the ranks and torchrun reported into one error that names the root cause.

The root cause is the first rank to fail, in the order the kernel heard of it, skipping
ranks that only failed because a peer vanished (a broken connection in a collective) or
because nbddp interrupted them (a session's ranks, after another one failed).
A rank that died without raising is described by torchrun's record of its exit.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence

from ..._errors import NbddpError, WorkerError
from ..._wire.messages import Disconnected, Failure, Result
from ..._wire.payload import loads_value
from ..._wire.rundir import RunDir
from ..records import Records

_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "DistNetworkError", "NCCL communicator was aborted", "Connection refused")
_LAUNCHER_TAIL_LINES = 30


def diagnose(
    reports: Sequence[Failure | Disconnected],
    results: Mapping[int, Result],
    run_dir: RunDir,
    records: Records,
    nprocs: int,
    logs: dict[int, str],
) -> NbddpError:
    exits = _read_exits(run_dir)
    candidates = list(reports) + [
        Disconnected(rank) for rank in sorted(exits, key=lambda r: exits[r]["timestamp"])
        if rank not in results and all(getattr(r, "rank", None) != rank for r in reports)
    ]
    if not candidates:
        missing = [rank for rank in range(nprocs) if rank not in results]
        if not missing:
            return NbddpError("torchrun failed after every rank returned")
        candidates = [Disconnected(missing[0])]
        if not any(logs.get(rank) for rank in missing):
            return NbddpError("torchrun failed before the ranks ran:\n" + _launcher_tail(run_dir))
    root = first_cause(candidates)
    if isinstance(root, Failure):
        error = _raised(root, logs)
    elif root.relay_lost and root.rank not in exits:
        error = WorkerError(root.rank, "was lost with its node: the relay it spoke "
                            "through (a node's torchrun process) stopped, and with it "
                            "that node's ranks (and, where it headed a group of relays, "
                            "the link to the group's other nodes)", logs=logs)
    else:
        error = _died(root.rank, exits.get(root.rank), logs)
    error.log_dir = str(records.path)
    return error


def first_cause(reports: Sequence[Failure | Disconnected]) -> Failure | Disconnected:
    """The first report that is not only a consequence of another one (``reports`` in the
    order the kernel heard of them; not empty)."""
    return next((r for r in reports if not secondary(r)), reports[0])


def describe(report: Failure | Disconnected) -> str:
    """One line for a failure: which rank, and what it raised or that it died."""
    if isinstance(report, Failure):
        return f"rank {report.rank} raised {report.type_name}: {report.message}"
    if report.relay_lost:
        return f"rank {report.rank} was lost with its node's relay"
    return f"rank {report.rank} exited without raising an exception"


def peer_lost(report: Failure | Disconnected) -> bool:
    return isinstance(report, Failure) and any(
        marker in f"{report.type_name}: {report.message}" for marker in _PEER_LOST
    )


def secondary(report: Failure | Disconnected) -> bool:
    """A failure caused by another one: a peer lost, or the interrupt nbddp sent to a
    session's ranks still running after another rank failed."""
    return peer_lost(report) or (isinstance(report, Failure)
                                 and report.type_name == "KeyboardInterrupt")


def _raised(failure: Failure, logs: dict[int, str]) -> WorkerError:
    error = WorkerError(failure.rank, f"raised {failure.type_name}: {failure.message}",
                        traceback=failure.traceback, exitcode=1, logs=logs)
    error.__cause__ = _original_exception(failure)
    return error


def _original_exception(failure: Failure) -> BaseException | None:
    """The rank's exception object, if the kernel can rebuild it without new imports."""
    importable = failure.module in ("builtins", "__main__") or failure.module in sys.modules
    if failure.exception is None or not importable:
        return None
    try:
        exc = loads_value(failure.exception)
    except Exception:
        return None
    return exc if isinstance(exc, BaseException) else None


def _died(rank: int, record: dict | None, logs: dict[int, str]) -> WorkerError:
    if record is None:
        return WorkerError(rank, "exited without reporting a result or an error", logs=logs)
    code, sig = record["exitcode"], record["signal"]
    if sig:
        summary = f"was killed by signal {sig} (exit code {code})"
    else:
        summary = f"exited with code {code} without raising an exception"
    return WorkerError(rank, summary, exitcode=code, signal=sig, logs=logs)


def _read_exits(run_dir: RunDir) -> dict[int, dict]:
    """torchrun's record of the ranks that exited abnormally, by global rank (each
    machine's torchrun writes its own file)."""
    exits: dict[int, dict] = {}
    for path in run_dir.failure_files():
        try:
            exits.update({int(rank): info for rank, info in json.loads(path.read_text()).items()})
        except (OSError, ValueError):
            continue
    return exits


def _launcher_tail(run_dir: RunDir) -> str:
    try:
        lines = run_dir.launcher_log.read_text(errors="replace").splitlines()
    except OSError:
        return "(torchrun left no output)"
    return "\n".join(lines[-_LAUNCHER_TAIL_LINES:])
