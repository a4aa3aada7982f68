"""What a terminal would show of a rank's output, as lines a notebook can hold.

Progress bars (tqdm under Lightning, HF Trainer, Accelerate) redraw their line with
``\\r``, draw nested bars one line down and come back with a cursor-up (``\\x1b[A``),
and clear lines with erase codes (``\\x1b[K``). A notebook cell cannot move back, so
the ``Screen`` plays the stream the way a terminal would and gives out two things: the
*final* lines, which the cursor has left for good and which go to the cell once, and
the *live* lines, still being redrawn, which a caller shows in place. No cursor or erase
code ever comes out; colours (SGR ``\\x1b[...m``) are kept, as Jupyter renders them.

A line the cursor left is final at once if it was written plainly (a ``print``). One
that was redrawn (a carriage return, an overwrite, an erase, the cursor came back up to
it) is final once the cursor has stayed off it for ``HOLD`` seconds: the bar above a
nested one is left for an instant at each refresh, a finished bar for good.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

HOLD = 0.5
"""Seconds a redrawn line must be left alone before it is final."""
HEIGHT = 50
"""The most live lines: above them, lines are final whatever their state (they scrolled
off a terminal this tall)."""
WIDTH = 1 << 16
"""The longest line kept; longer ones wrap here (a terminal would wrap far sooner)."""
_MAX_PENDING = 4096  # an escape sequence cut by a read waits this long for its end

_TOKEN = re.compile(
    r"(?P<text>[^\x00-\x08\x0b-\x1f\x7f]+)"  # text: printable, tabs, line feeds
    r"|\x1b\[(?P<params>[0-?]*)[ -/]*(?P<final>[@-~])"  # CSI: cursor, erase, colour
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"  # OSC: title, hyperlink (dropped)
    r"|\x1b(?P<esc>[ -/]*[0-Z\\^-~])"  # other escapes: save/restore cursor, reverse index
    r"|(?P<ctl>[\x00-\x1f\x7f])", re.DOTALL)
_PARTIAL = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*\x1b?|[ -/]*)?")
"""The start of an escape sequence that the next read completes."""


@dataclass
class _Line:
    chars: list[str] = field(default_factory=list)
    styles: list[str] | None = None
    """Each character's colour (SGR codes), once one is not the default."""
    redrawn: bool = False
    seen: float = 0.0
    """When the cursor was last on this line."""

    def put(self, col: int, text: str, style: str) -> None:
        if col < len(self.chars):
            self.redrawn = True
        elif col > len(self.chars):
            self.pad(col)
        self.chars[col:col + len(text)] = text
        if style or self.styles is not None:
            if self.styles is None:
                self.styles = []
            self.pad_styles()
            self.styles[col:col + len(text)] = [style] * len(text)

    def pad(self, col: int) -> None:
        self.chars.extend(" " * (col - len(self.chars)))
        if self.styles is not None:
            self.pad_styles()

    def pad_styles(self) -> None:
        assert self.styles is not None
        self.styles.extend([""] * (len(self.chars) - len(self.styles)))

    def erase(self, start: int, end: int | None = None) -> None:
        """Blank ``start:end``; to the end of the line when ``end`` is None."""
        self.redrawn = True
        if end is None or end >= len(self.chars):
            del self.chars[start:]
            if self.styles is not None:
                del self.styles[start:]
            return
        self.chars[start:end] = " " * (end - start)
        if self.styles is not None:
            self.styles[start:end] = [""] * (end - start)

    def delete(self, col: int, n: int) -> None:
        """Remove ``n`` characters at ``col``; the rest of the line moves left."""
        self.redrawn = True
        del self.chars[col:col + n]
        if self.styles is not None:
            del self.styles[col:col + n]

    def render(self) -> str:
        """The line as text: colour codes only where the colour changes; trailing
        blanks of the default colour dropped."""
        end = len(self.chars)
        while end and self.chars[end - 1] == " " and not (self.styles and self.styles[end - 1]):
            end -= 1
        if not self.styles:
            return "".join(self.chars[:end])
        out, current = [], ""
        for char, style in zip(self.chars[:end], self.styles[:end], strict=True):
            if style != current:
                out.append(("\x1b[0m" if current else "") + style)
                current = style
            out.append(char)
        return "".join(out) + ("\x1b[0m" if current else "")


def _render(line: _Line | str) -> str:
    return line.rstrip(" ") if isinstance(line, str) else line.render()


class Screen:
    """A terminal's lines below the last final one, and its cursor.

    ``feed`` the text as it comes (any pieces), then ``take_final`` the lines that are
    final now and show ``live()`` in place; ``end()`` when the stream is over.
    """

    def __init__(self, hold: float = HOLD, height: int = HEIGHT, width: int = WIDTH) -> None:
        self._hold, self._height, self._width = hold, height, width
        self._lines: list[_Line | str] = [_Line()]
        """The lines not final yet; a ``str`` is one written plainly in one piece (made a
        ``_Line`` if the cursor comes back to it)."""
        self._row = self._col = 0
        self._style = ""
        self._sgrs: list[str] = []
        self._saved = (0, 0)
        self._cr = False  # a carriage return came, not yet followed by anything
        self._pending = ""  # an escape sequence cut by the end of what was fed
        self._now = 0.0
        self.version = 0
        """Changes whenever the lines may have changed (for callers that redraw)."""

    @property
    def cursor(self) -> int:
        """The cursor's line in ``live()``: lines above it are left but may come back."""
        return self._row

    def feed(self, text: str, now: float) -> None:
        self._now, self.version = now, self.version + 1
        text, self._pending = self._pending + text, ""
        for token in _TOKEN.finditer(text):
            kind = token.lastgroup
            if kind == "text":
                self._text(token.group())
            elif kind == "final":
                self._csi(token["params"], token["final"], token.group())
            elif kind == "esc":
                self._escape(token["esc"])
            elif kind == "ctl":
                if token.group() == "\x1b" and _PARTIAL.fullmatch(text, token.start()) \
                        and len(text) - token.start() < _MAX_PENDING:
                    self._pending = text[token.start():]
                    break
                self._control(token.group())
        self._at(self._row).seen = now

    def take_final(self, now: float) -> list[str]:
        """The lines that became final, in order, without line ends."""
        count, over = 0, len(self._lines) - self._height
        for line in self._lines[:self._row]:
            if (isinstance(line, _Line) and line.redrawn and now - line.seen < self._hold
                    and count >= over):
                break
            count += 1
        if not count:
            return []
        final = [_render(line) for line in self._lines[:count]]
        del self._lines[:count]
        self._row -= count
        self._saved = (max(0, self._saved[0] - count), self._saved[1])
        self.version += 1
        return final

    def settling(self, now: float) -> bool:
        """The only line left is plain text still waiting for its line end, written a
        moment ago: a line read in two pieces (it will be final at the next look), not
        one to show in place yet."""
        if len(self._lines) != 1 or self._row != 0:
            return False
        line = self._lines[0]
        return (isinstance(line, str) or not line.redrawn and now - line.seen < self._hold) \
            and bool(_render(line).strip())

    def live(self) -> list[str]:
        """The lines still being drawn: those above the cursor, then the cursor's and
        those below it up to the last that is not blank."""
        rendered = [_render(line) for line in self._lines]
        end = len(rendered)
        while end > self._row and not rendered[end - 1].strip():
            end -= 1
        return rendered[:end]

    def end(self) -> list[str]:
        """The stream is over: every line left is final (a blank last line is none)."""
        final = self.live()
        self._lines, self._row, self._col = [_Line()], 0, 0
        self.version += 1
        return final

    # --- what each piece does -------------------------------------------------------

    def _at(self, row: int) -> _Line:
        line = self._lines[row]
        if isinstance(line, str):
            line = self._lines[row] = _Line(list(line), seen=self._now)
        return line

    def _redraw_mark(self) -> None:
        """A carriage return followed by anything but a line feed redraws the line."""
        if self._cr:
            self._at(self._row).redrawn = True
            self._cr = False

    def _text(self, text: str) -> None:
        """Text and line feeds; whole plain lines at the bottom are kept as they come."""
        first, *rest = text.split("\n")
        self._write(first)
        if not rest:
            return
        self._cr = False  # a line feed after a carriage return ends the line plainly
        self._newline()
        *whole, last = rest
        line = self._lines[self._row]
        if (whole and self._row == len(self._lines) - 1 and not self._style
                and isinstance(line, _Line) and not line.chars
                and max(map(len, whole)) <= self._width):
            self._lines[self._row:] = [*whole, line]
            self._row += len(whole)
        else:
            for piece in whole:
                self._write(piece)
                self._newline()
        self._write(last)

    def _write(self, text: str) -> None:
        if text:
            self._redraw_mark()
        while text:
            room = self._width - self._col
            if room <= 0:
                self._newline()
                room = self._width
            piece, text = text[:room], text[room:]
            self._at(self._row).put(self._col, piece, self._style)
            self._col += len(piece)

    def _control(self, char: str) -> None:
        if char in "\x0b\x0c":  # vertical tab, form feed: a line feed
            self._cr = False
            self._newline()
        elif char == "\r":
            self._redraw_mark()
            self._cr, self._col = True, 0
        elif char == "\b":
            self._at(self._row).redrawn = True
            self._col = max(0, self._col - 1)
        # other control characters (bell...) show nothing

    def _newline(self) -> None:
        if self._row == len(self._lines) - 1:
            self._lines.append(_Line())
        self._goto(self._row + 1, 0)

    def _goto(self, row: int, col: int | None = None) -> None:
        """Move the cursor; a line it comes back up to is being redrawn."""
        row = max(0, min(row, len(self._lines) - 1))
        self._at(self._row).seen = self._now
        if row < self._row:
            self._at(row).redrawn = True
        self._row = row
        self._at(row).seen = self._now
        if col is not None:
            self._col = max(0, col)

    def _escape(self, code: str) -> None:
        self._redraw_mark()
        if code == "7":
            self._saved = (self._row, self._col)
        elif code == "8":
            self._goto(*self._saved)
        elif code == "M":
            self._goto(self._row - 1)
        elif code == "D":
            self._goto(self._row + 1)
        elif code == "E":
            self._newline()

    def _csi(self, params: str, final: str, sequence: str) -> None:
        self._redraw_mark()
        if final == "m":
            self._sgr(params, sequence)
        elif params[:1] not in ("?", "<", "=", ">"):  # private modes draw nothing
            numbers = [int(p) if p.isdigit() else 0 for p in params.split(";")]
            self._cursor_or_erase(final, numbers)

    def _cursor_or_erase(self, final: str, numbers: list[int]) -> None:
        n, at_least_one = numbers[0], max(numbers[0], 1)
        if final in "AF":
            self._goto(self._row - at_least_one, 0 if final == "F" else None)
        elif final in "BE":
            self._goto(self._row + at_least_one, 0 if final == "E" else None)
        elif final in "CD":
            self._col = max(0, self._col + (at_least_one if final == "C" else -at_least_one))
        elif final == "G":
            self._col = at_least_one - 1
        elif final in "Hf":
            row, col = (numbers + [1, 1])[:2]
            self._goto(max(row, 1) - 1, max(col, 1) - 1)
        elif final == "d":
            self._goto(at_least_one - 1)
        elif final == "K":
            self._erase_line(n)
        elif final == "J":
            self._erase_screen(n)
        elif final == "X":
            self._at(self._row).erase(self._col, self._col + at_least_one)
        elif final == "P":
            self._at(self._row).delete(self._col, at_least_one)
        elif final == "s":
            self._saved = (self._row, self._col)
        elif final == "u":
            self._goto(*self._saved)

    def _erase_line(self, how: int) -> None:
        line = self._at(self._row)
        if how == 0:
            line.erase(self._col)
        elif how == 1:
            line.erase(0, min(self._col + 1, len(line.chars)))
        else:
            line.erase(0)

    def _erase_screen(self, how: int) -> None:
        if how == 0:
            self._at(self._row).erase(self._col)
            del self._lines[self._row + 1:]
            return
        rows = range(self._row + 1) if how == 1 else range(len(self._lines))
        for row in rows:
            self._at(row).erase(0, self._col + 1 if how == 1 and row == self._row else None)

    def _sgr(self, params: str, sequence: str) -> None:
        """Colours: the codes since the last reset (the last few) make the current one."""
        if params in ("", "0"):
            self._sgrs = []
        elif params.startswith("0;"):
            self._sgrs = [sequence]
        else:
            self._sgrs = [*self._sgrs[-7:], sequence]
        self._style = "".join(self._sgrs)
