"""Forward ranks' log files to the notebook as they grow, within bounds.

What a rank writes is played on a terminal ``Screen``: lines that are final go to the
sink once, in order; lines still being redrawn (progress bars) are shown in place, in a
display under the cell that is updated (``DisplayedLines``), or where displays cannot
update, as a snapshot every ``SNAPSHOT_EVERY`` seconds (``SnapshotLines``). No cursor
code and no carriage return reaches the notebook, and a bar is not one line per refresh.
"""

from __future__ import annotations

import codecs
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from .terminal import Screen

_CHUNK = 1 << 16
SNAPSHOT_EVERY = 10.0
"""Seconds between two snapshots of the lines being redrawn, in text output."""
_UPDATE_EVERY = 0.1  # a display of live lines is updated at most ten times a second
_MAX_DISPLAYS = 50  # displays one tail makes; past them, live lines show when final
_LIVE_WIDTH = 1000  # characters of a live line shown (the whole line once final)


class Sink(Protocol):
    def write(self, text: str) -> None: ...
    def flush(self) -> None: ...


class LiveLines(Protocol):
    """Where a tail's lines go: the final ones, in order, and the live ones."""

    def update(self, final: list[str], live: list[str], cursor: int, now: float) -> None:
        """``final`` lines are done, to be shown once; ``live`` are still being redrawn:
        ``live[cursor:]`` at the cursor and below it, ``live[:cursor]`` left above it
        (final soon, unless the cursor comes back up)."""


class LogTail:
    """Shows what was appended to ``path`` since the last ``pump`` through ``sink``, from
    ``start`` on and up to where ``end()`` says, once it says (a session's cell: its part
    of the log, which the next cell's part follows); ``shown(offset)`` hears how far it
    has read, each time it read more.

    With a ``prefix`` (several ranks interleaved) every line is prefixed. Lines being
    redrawn show in place under the cell with ``in_place`` (a Jupyter kernel), else as
    snapshots every ``SNAPSHOT_EVERY`` seconds.
    """

    def __init__(self, path: Path, sink: Sink, prefix: str = "", in_place: bool = False,
                 clock: Callable[[], float] = time.monotonic, start: int = 0,
                 end: Callable[[], int | None] = lambda: None,
                 shown: Callable[[int], None] | None = None) -> None:
        self.path, self._prefix, self._clock, self._start = path, prefix, clock, start
        self._end = end
        self._file: BinaryIO | None = None
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._screen = Screen()
        self._lines: LiveLines = DisplayedLines(sink) if in_place else SnapshotLines(sink)
        self._version = self._screen.version
        self._live: list[str] = []  # the live lines last shown, prefixed
        self._shown = shown

    def pump(self) -> None:
        if self._file is None:
            end = self._end()
            if end is not None and end <= self._start:
                return  # (nothing written, as in most quick cells: not even looked at)
            try:  # (nothing written yet: the file is not opened, a fifth of the time)
                if end is None and os.stat(self.path).st_size <= self._start:
                    return
                self._file = open(self.path, "rb")  # noqa: SIM115 - kept open between pumps
            except FileNotFoundError:
                return
            self._file.seek(self._start)
        text = ""
        while chunk := self._file.read(self._readable()):
            text += self._decoder.decode(chunk)
        if text and self._shown is not None:
            self._shown(self._file.tell())
        now = self._clock()
        if text:
            self._screen.feed(text, now)
        final = self._screen.take_final(now)
        settling = self._screen.settling(now)  # a line read before its end: wait for it
        if final or (self._screen.version != self._version and not settling):
            if not settling:
                self._version = self._screen.version
            self._show(final, [] if settling else self._screen.live(), now)
        else:
            self._lines.update([], self._live, self._screen.cursor, now)  # a snapshot's time

    def _readable(self) -> int:
        """(The file open) How much the next read may take."""
        assert self._file is not None
        end = self._end()
        return _CHUNK if end is None else max(0, min(_CHUNK, end - self._file.tell()))

    def _show(self, final: list[str], live: list[str], now: float) -> None:
        if self._prefix:
            final = [self._prefix + line for line in final]
            live = [self._prefix + line for line in live]
        self._live = live
        self._lines.update(final, live, self._screen.cursor, now)

    def close(self) -> None:
        self.pump()
        text = self._decoder.decode(b"", final=True)
        if text:
            self._screen.feed(text, self._clock())
        self._show(self._screen.end(), [], self._clock())
        if self._file is not None:
            self._file.close()
            self._file = None


class DisplayedLines:
    """Live lines in one display under the cell, updated in place (a Jupyter kernel).

    Final lines go to the sink, below the display; when the live lines end and nothing
    was written below the display since it was made, their last state stays in it.
    """

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self._handle: Any = None
        self._shown = ""
        self._at = 0.0
        self._below = False  # lines were written below the display
        self._made = 0

    def update(self, final: list[str], live: list[str], cursor: int, now: float) -> None:
        if final and not live and self._handle is not None and not self._below:
            self._set("\n".join(final))  # the display keeps the lines' last state
            self._handle = None
            return
        if final:
            _write_lines(self._sink, final)
            self._below = self._handle is not None
        text = "\n".join(map(_clip, live))
        if self._handle is None:
            if text and self._made < _MAX_DISPLAYS:
                self._make(text, now)
        elif text != self._shown and (not text or now - self._at >= _UPDATE_EVERY):
            self._set(text)  # else coalesced: a later pump shows it
            self._at = now
            if not text:
                self._handle = None

    def _make(self, text: str, now: float) -> None:
        from IPython.display import display

        self._made += 1
        self._sink.flush()
        self._handle = display({"text/plain": text}, raw=True, display_id=True)
        self._shown, self._at, self._below = text, now, False

    def _set(self, text: str) -> None:
        self._handle.update({"text/plain": text}, raw=True)
        self._shown = text


class SnapshotLines:
    """Live lines written as ordinary lines every ``SNAPSHOT_EVERY`` seconds: a plain
    stream (a terminal, a file, a pipe) keeps what is written."""

    def __init__(self, sink: Sink, every: float = SNAPSHOT_EVERY) -> None:
        self._sink, self._every = sink, every
        self._since: float | None = None
        self._last: list[str] = []

    def update(self, final: list[str], live: list[str], cursor: int, now: float) -> None:
        if final:
            _write_lines(self._sink, final)
        current = [line for line in live[cursor:] if line.strip()]
        if not current:
            self._since = None
        elif self._since is None:
            self._since = now
        elif now - self._since >= self._every and current != self._last:
            _write_lines(self._sink, current)
            self._since, self._last = now, current


def _clip(line: str) -> str:
    """At most ``_LIVE_WIDTH`` characters of a live line, no colour code cut in two."""
    if len(line) <= _LIVE_WIDTH:
        return line
    cut = line[:_LIVE_WIDTH]
    start = cut.rfind("\x1b")
    if start >= 0 and "m" not in cut[start:]:
        cut = cut[:start]
    return cut + ("\x1b[0m" if "\x1b[" in cut else "") + "…"


def _write_lines(sink: Sink, lines: list[str]) -> None:
    sink.write("".join(line + "\n" for line in lines))
    sink.flush()


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
