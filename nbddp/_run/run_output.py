"""What one run shows under its cell as text: the ranks' output, and nbddp's own lines.

The ranks' logs are tailed (``_panel.output.LogTail``) into one bounded sink: rank 0's
(or the first rank the run was given), every rank's with a ``[rank N]`` prefix, or none,
as ``RunConfig.output`` says. A line of nbddp's own (a restart, a stall, a backend's
news) goes after what the ranks wrote so far, so that it reads in the order it happened.

Nothing here refers back to the supervisor: its debugger keeps ``note_now`` and may
note a refused prompt after the run (see ``Supervisor.release``).
"""

from __future__ import annotations

import functools

from .._panel.output import BoundedOutput, LogTail
from .._panel.state import Panel
from .._panel.widget_panel import WidgetPanel
from .config import RunConfig
from .records import Records


class RunOutput:
    """The ranks' output in one run as it comes, and nbddp's lines among it."""

    def __init__(self, panel: Panel, records: Records, config: RunConfig) -> None:
        self._records = records
        self._sink = BoundedOutput(panel.write, records.path)
        in_place = isinstance(panel, WidgetPanel)  # progress bars update under the cell
        running = config.running_ranks  # (rank 0, unless a session's run is not on it)
        self._tails: list[LogTail] = []
        if config.output == "rank0":
            self._tails = [self._tail(running[0], "", in_place)]
        elif config.output == "all":
            self._tails = [self._tail(r, f"[rank {r}] ", in_place) for r in running]

    def _tail(self, rank: int, prefix: str, in_place: bool) -> LogTail:
        """``rank``'s output in this run, shown as it comes."""
        records = self._records
        return LogTail(records.rank_log(rank), self._sink, prefix=prefix, in_place=in_place,
                       start=records.log_start(rank), end=lambda: records.log_end(rank),
                       shown=functools.partial(records.shown, rank))

    def write(self, text: str) -> None:
        """Show ``text`` (nbddp's or a backend's own) now, within the output's bounds."""
        self._sink.write(text)

    def pump(self) -> None:
        """Show what the ranks wrote since the last look."""
        for tail in self._tails:
            tail.pump()

    def note_now(self, line: str) -> None:
        """A line of nbddp's own, after the ranks' output so far."""
        self.pump()
        self._sink.write(line)

    def close(self) -> None:
        """The run is over: the last of the ranks' output, and what the bounds held back."""
        self.pump()
        for tail in self._tails:
            tail.close()
        self._sink.close()
