"""What a session's ranks hold, as the kernel knows it: the names their code bound (a
cell that reads one gets the ranks' value, not the notebook's), and the notebook changes
they cannot take up (warned of once each). Fresh ranks hold nothing."""

from __future__ import annotations

import warnings

from .on_session import OnSession


class SessionNames:
    """The names a session's ranks hold (rank 0's), and the warnings already given."""

    def __init__(self, bound: frozenset[str] = frozenset()) -> None:
        self.bound = bound
        self._warned: set[str] = set()

    def kept(self, run: OnSession, some_ranks: bool) -> None:
        """``run`` ended with the ranks' state kept: the names it bound are held now (a
        run on ``some_ranks`` adds to what the others had)."""
        if run.names is not None:
            self.bound = (self.bound if some_ranks else frozenset()) | frozenset(run.names)

    def lost(self) -> None:
        """Fresh ranks: they hold nothing, and a change is worth a warning again."""
        self.bound = frozenset()
        self._warned.clear()

    def warn_left_out(self, names: list[str]) -> None:
        """Once per variable: a notebook change the running ranks cannot take up."""
        new = [name for name in names if name not in self._warned]
        if new:
            self._warned.update(new)
            warnings.warn(f"{', '.join(new)} changed in the notebook, but the session's ranks "
                          "read them when they started: restart the session "
                          "(%ddp_session restart) for the new values", stacklevel=3)
