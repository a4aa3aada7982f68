"""The exceptions users catch.

    Exception
    └── NbddpError                 anything nbddp raises on purpose
        ├── WorkerError            a rank raised, crashed or was killed
        └── PayloadError(TypeError) something cannot be sent to the ranks

A run that exceeds ``timeout`` raises the builtin ``TimeoutError``; an interrupted
wait raises ``KeyboardInterrupt``; a cancelled ``Job`` raises
``concurrent.futures.CancelledError``. Bad options raise ``ValueError``/``TypeError``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

TAIL_LINES = 20


class NbddpError(Exception):
    """Base class of the errors nbddp raises."""


class PayloadError(NbddpError, TypeError):
    """A function, argument or captured object cannot be pickled for the ranks."""

    def _render_traceback_(self) -> list[str]:
        """In IPython the message says it all; the pickler's internals are noise."""
        return [f"\x1b[31mPayloadError\x1b[0m: {self}"]


class WorkerError(NbddpError):
    """A rank failed. The first rank that failed (the root cause) is ``rank``.

    ``traceback`` is the remote traceback as text (``None`` when the rank died
    without raising), ``exitcode``/``signal`` describe how the process ended where
    known, ``logs`` maps every rank to its output, and ``log_dir`` is the folder
    where every rank's full log is kept.
    """

    def __init__(
        self,
        rank: int,
        summary: str,
        *,
        traceback: str | None = None,
        exitcode: int | None = None,
        signal: str | None = None,
        logs: dict[int, str] | None = None,
        log_dir: str | None = None,
        note: str | None = None,
        attempts: int = 1,
        earlier: list[str] | None = None,
    ) -> None:
        super().__init__(f"rank {rank} {summary}")
        self.rank = rank
        self.summary = summary
        self.traceback = traceback
        self.exitcode = exitcode
        self.signal = signal
        self.logs: dict[int, str] = dict(logs or {})
        self.log_dir = log_dir
        self.note = note
        """What became of a session's ranks (their state kept, or restarted)."""
        self.attempts = attempts
        """How many times the ranks ran (1, or more with ``max_restarts``): this error
        is the last attempt's."""
        self.earlier: list[str] = list(earlier or [])
        """Why each earlier attempt failed, one line each."""

    def __reduce__(self):
        kwargs = dict(traceback=self.traceback, exitcode=self.exitcode,
                      signal=self.signal, logs=self.logs, log_dir=self.log_dir, note=self.note,
                      attempts=self.attempts, earlier=self.earlier)
        return _rebuild_worker_error, (self.rank, self.summary, kwargs)

    @property
    def output_tail(self) -> str:
        """The last lines the failing rank printed (stdout and stderr)."""
        lines = self.logs.get(self.rank, "").splitlines()
        return "\n".join(lines[-TAIL_LINES:])

    def __str__(self) -> str:
        parts = [super().__str__()]
        if self.attempts > 1:
            parts.append(f"(on the last of {self.attempts} attempts: torchrun restarted every "
                         f"rank {self.attempts - 1} time(s) and no restart is left; earlier: "
                         + "; ".join(self.earlier) + ")")
        if self.traceback:
            parts.append(f"\n--- traceback from rank {self.rank} (root cause) ---\n"
                         + self.traceback.rstrip())
        elif self.output_tail:
            parts.append(f"\n--- last lines of rank {self.rank}'s output ---\n"
                         + self.output_tail)
        if self.log_dir:
            parts.append(f"\n(every rank's full output: .logs[rank], and {self.log_dir})")
        elif self.logs:
            parts.append(f"\n(every rank's full output: .logs[rank], ranks {sorted(self.logs)})")
        if self.note:
            parts.append(f"({self.note})")
        return "\n".join(parts)

    def _render_traceback_(self) -> list[str]:
        """How IPython shows this error: the remote traceback, labelled by rank, with
        notebook cells named as IPython names them (``Cell In[5], line 3``)."""
        red, reset = "\x1b[31m", "\x1b[0m"
        return [f"{red}WorkerError{reset}: " + name_cells(str(self))]


def name_cells(text: str) -> str:
    """In IPython: notebook cells' file names in ``text`` (a traceback, or pdb's place)
    as the notebook names them."""
    namer = _cell_namer()
    if namer is None:
        return text

    def rename(match: re.Match) -> str:
        name = namer(match.group(1))
        return f"{name[0]} {name[1]}, line" if name else match.group(0)

    def rename_pdb(match: re.Match) -> str:  # pdb's "> FILE(LINE)function()"
        name = namer(match.group(1))
        return f"> {name[0]} {name[1]}({match.group(2)})" if name else match.group(0)

    text = re.sub(r'File "([^"]+)", line', rename, text)
    return re.sub(r"^> (.+?)\((\d+)\)", rename_pdb, text, flags=re.MULTILINE)


def cell_name(filename: str) -> str | None:
    """In IPython: the notebook's name of a cell's file (``Cell In[5]``); None for a file
    that is no cell, or outside IPython."""
    namer = _cell_namer()
    name = namer(filename) if namer is not None else None
    return f"{name[0]} {name[1]}" if name else None


def _cell_namer() -> Callable[[str], tuple[str, str] | None] | None:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return getattr(getattr(shell, "compile", None), "format_code_name", None)


def _rebuild_worker_error(rank: int, summary: str, kwargs: dict) -> WorkerError:
    return WorkerError(rank, summary, **kwargs)
