"""The value a run gives back: rank 0's return value, or every rank's, decoded (of a
session's run on some ranks: the lowest one's, or each one's).

A value comes pickled in its ``Result``, or, when it holds tensor or array bytes, in a
data file that the rank wrote (in shared memory if it fitted). The file is mapped, then
removed; the mapping stays as long as the value lives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .._errors import NbddpError
from .._wire import dataplane
from .._wire.messages import Result
from .._wire.payload import loads_value


def run_value(results: Mapping[int, Result], all_ranks: bool, running: Sequence[int],
              got: Callable[[int], None]) -> Any:
    """The first ``running`` rank's return value (rank 0's), or each running rank's with
    ``all_ranks``; an ``NbddpError`` if one cannot be unpickled in the notebook. ``got``
    is told how many bytes of data the first one's result file held, once it is read (the
    next run's room for its result is made that large)."""
    ranks = list(running) if all_ranks else [running[0]]
    for rank in ranks:
        if results[rank].file == "":  # (it came over the channel, to no room here)
            raise NbddpError(f"rank {rank}'s return value did not fit on this machine: no "
                             "room for its data in shared memory or in the run's folder")
    try:
        values = [_value_of(results[r], got if r == running[0] else None) for r in ranks]
    except Exception as exc:
        raise NbddpError(f"the run finished, but its return value cannot be unpickled in "
                         f"the notebook: {type(exc).__name__}: {exc}") from exc
    return values if all_ranks else values[0]


def _value_of(result: Result, got: Callable[[int], None] | None) -> Any:
    """A rank's return value; its data file is mapped, then removed (the mapping stays)."""
    if result.file is None:
        return loads_value(result.value or b"")
    path = Path(result.file)
    try:
        packed = dataplane.read(path)
    finally:
        path.unlink(missing_ok=True)
    if got is not None:
        got(packed.buffer_bytes)
    return packed.load()
