"""Forward ranks' log files to the notebook as they grow."""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import BinaryIO, TextIO

_CHUNK = 1 << 16


class LogTail:
    """Writes what was appended to ``path`` since the last ``pump`` to ``sink``.

    With a ``prefix`` (several ranks interleaved) only whole lines are written, each
    prefixed; without one the text passes through as is, carriage returns included.
    """

    def __init__(self, path: Path, sink: TextIO, prefix: str = "") -> None:
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
