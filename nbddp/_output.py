"""Forward a rank's log file to the notebook as it grows."""

from __future__ import annotations

import codecs
import os
from pathlib import Path
from typing import BinaryIO, TextIO

_CHUNK = 1 << 16


class LogTail:
    """Reads what was appended to ``path`` since the last call and writes it to ``sink``."""

    def __init__(self, path: Path, sink: TextIO) -> None:
        self.path, self._sink = path, sink
        self._file: BinaryIO | None = None
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def pump(self) -> None:
        if self._file is None:
            try:
                self._file = open(self.path, "rb")  # noqa: SIM115 - kept open between pumps
            except FileNotFoundError:
                return
        wrote = False
        while chunk := self._file.read(_CHUNK):
            self._sink.write(self._decoder.decode(chunk))
            wrote = True
        if wrote:
            self._sink.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def size(self) -> int:
        return os.fstat(self._file.fileno()).st_size if self._file else 0
