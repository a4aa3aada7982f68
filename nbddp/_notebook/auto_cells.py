"""``%ddp_session auto on``: every cell runs on the session's ranks, as if it began with
``%%ddp`` (ipyparallel's ``%autopx``, nbdistributed's ``%dist_mode``).

An IPython input transformer puts a ``%%ddp`` line on top of each cell while auto mode
is on (the open session says so: there is no other switch). It sits in
``input_transformers_cleanup``, which IPython applies before it looks for magics, so the
line is then read as any ``%%ddp`` line is. Cells whose first line begins with ``%`` or
``!`` (a magic, ``%ddp_session`` itself, a shell command) stay in the notebook, as do
empty cells; so does every cell once the session is closed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

AUTO_LINE = "%%ddp --auto-cell\n"
"""What a cell is given on top: ``--auto-cell`` tells ``%%ddp`` that the cell's own first
line is its line 1 (a written ``%%ddp`` line is the cell's line 1 otherwise)."""


def install(shell: Any, on: Callable[[], bool]) -> None:
    """Register the transformer with ``shell`` (in place of one an earlier load of the
    extension registered); it acts while ``on()`` says auto mode is on."""
    transformers = shell.input_transformers_cleanup
    transformers[:] = [t for t in transformers if not isinstance(t, AutoCells)]
    transformers.append(AutoCells(on))


class AutoCells:
    """The transformer."""

    def __init__(self, on: Callable[[], bool]) -> None:
        self._on = on

    def __call__(self, lines: list[str]) -> list[str]:
        if not self._on():
            return lines
        first = next((line for line in lines if line.strip()), None)
        if first is None or first.lstrip().startswith(("%", "!")):
            return lines
        return [AUTO_LINE, *lines]
