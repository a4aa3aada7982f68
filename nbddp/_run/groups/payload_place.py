"""Where a waiting group's run payload travels to its ranks: inside the Start, or a file.

A payload this small (``INLINE_PAYLOAD``) that holds no tensor or array data travels
inside its ``Start``: no file to write and map (a session's quick cells). Any other is
written where the ranks read it (the backend says where: ``WaitingGroup._place_payload``),
and the file of the run before is removed first. The payload itself is kept until the
ranks have taken it: the kept copies of tensors it names stay open
(``_wire.kept_storages``) until the ranks have mapped them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from ..._wire.dataplane import Packed
from ..._wire.messages import Start

INLINE_PAYLOAD = 256 * 2**10
"""A payload this small without data buffers travels inside its Start."""


def with_payload_inside(start: Start, payload: Packed) -> Start | None:
    """``start`` carrying ``payload`` itself, if it is small and holds no tensor or
    array data; else None (it goes in a data file)."""
    if payload.buffers or len(payload.data) > INLINE_PAYLOAD:
        return None
    return dataclasses.replace(start, packed=payload.data)


class PayloadPlace:
    """The latest run's payload, and the file it went in (if it did not fit its Start)."""

    def __init__(self) -> None:
        self._file: Path | None = None
        self._payload: Packed | None = None

    def start_for(self, start: Start, payload: Packed,
                  place: Callable[[Packed], Path]) -> Start:
        """``start`` with ``payload`` placed: inside it if it may be, else in the file
        ``place(payload)`` writes and names."""
        if self._file is not None:
            self._file.unlink(missing_ok=True)
            self._file = None
        self._payload = payload
        inline = with_payload_inside(start, payload)
        if inline is not None:
            return inline
        self._file = place(payload)
        return dataclasses.replace(start, payload=str(self._file))

    def taken(self) -> None:
        """The ranks have taken the payload (or the group is closed): it need not be kept."""
        self._payload = None
