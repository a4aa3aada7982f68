"""Forward ranks' log files to the notebook as they grow, within bounds."""

from __future__ import annotations

import codecs
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

_CHUNK = 1 << 16


class Sink(Protocol):
    def write(self, text: str) -> None: ...
    def flush(self) -> None: ...


class LogTail:
    """Writes what was appended to ``path`` since the last ``pump`` to ``sink``.

    With a ``prefix`` (several ranks interleaved) only whole lines are written, each
    prefixed; without one the text passes through as is, carriage returns included.
    """

    def __init__(self, path: Path, sink: Sink, prefix: str = "") -> None:
        self.path, self._sink, self._prefix = path, sink, prefix
        self._file: BinaryIO | None = None
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""

    def pump(self) -> None:
        if self._file is None:
            try:
                self._file = open(self.path, "rb")  # noqa: SIM115 - kept open between pumps
            except FileNotFoundError:
                return
        text = ""
        while chunk := self._file.read(_CHUNK):
            text += self._decoder.decode(chunk)
        if text:
            self._write(text)

    def _write(self, text: str) -> None:
        if self._prefix:
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
            if not lines:
                return
            text = "".join(f"{self._prefix}{line}\n" for line in lines)
        self._sink.write(text)
        self._sink.flush()

    def close(self) -> None:
        self.pump()
        if self._partial:
            self._sink.write(f"{self._prefix}{self._partial}\n")
            self._sink.flush()
            self._partial = ""
        if self._file is not None:
            self._file.close()
            self._file = None


class BoundedOutput:
    """A sink that shows at most ``max_lines`` lines, then points at the full log.

    A rank printing 100,000 lines must not freeze the notebook: past the budget only a
    notice is shown, and when the run ends the last lines are shown too.
    """

    def __init__(self, write: Callable[[str], None], log_path: Path, max_lines: int = 1000,
                 tail_lines: int = 20) -> None:
        self._write, self._log_path = write, log_path
        self._budget, self._tail_lines = max_lines, tail_lines
        self._hidden = 0
        self._tail: deque[str] = deque(maxlen=tail_lines)

    def write(self, text: str) -> None:
        if self._hidden == 0:
            shown, rest = _split_lines(text, self._budget)
            self._budget -= shown.count("\n")
            if shown:
                self._write(shown)
            if not rest:
                return
            self._write(f"\n[nbddp] more output than fits here; the full log is "
                        f"{self._log_path}\n")
            text = rest
        self._hidden += text.count("\n")
        self._tail.extend(text.splitlines())

    def flush(self) -> None:
        """Part of the file-like interface; writes are passed on at once."""

    def close(self) -> None:
        if self._hidden:
            self._write(f"[nbddp] {self._hidden} lines not shown; the last "
                        f"{len(self._tail)}:\n" + "\n".join(self._tail) + "\n")
            self._hidden = 0


def _split_lines(text: str, budget: int) -> tuple[str, str]:
    """(the first ``budget`` lines of text, the rest)."""
    if budget <= 0:
        return "", text
    end = -1
    for _ in range(budget):
        end = text.find("\n", end + 1)
        if end < 0:
            return text, ""
    return text[:end + 1], text[end + 1:]
