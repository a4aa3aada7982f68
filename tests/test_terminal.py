"""The terminal model that turns a rank's output into notebook lines, and the tail that
feeds it: carriage returns, nested bars, erase codes, pieces, bounds."""

from __future__ import annotations

import io
import re

import pytest

from nbddp._panel.output import BoundedOutput, DisplayedLines, LogTail, SnapshotLines
from nbddp._panel.terminal import HOLD, Screen

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast

CURSOR_CODES = re.compile(r"\x1b\[[0-9;?]*[A-HJKSTfhlnsu]")


def play(*pieces: str, step: float = 0.01) -> tuple[list[str], list[str]]:
    """Feed ``pieces`` one after the other (``step`` seconds apart): (the lines that were
    final before the end, every line once the stream ended)."""
    screen, now, final = Screen(), 0.0, []
    for piece in pieces:
        screen.feed(piece, now)
        final += screen.take_final(now)
        now += step
    return final, final + screen.end()


def test_plain_lines_are_final_at_once_and_a_partial_one_at_the_end():
    screen = Screen()
    screen.feed("one\ntwo\nthr", 0.0)
    assert screen.take_final(0.0) == ["one", "two"]
    assert screen.live() == ["thr"]
    screen.feed("ee\nfour", 0.0)
    assert screen.take_final(0.0) == ["three"]
    assert screen.end() == ["four"]
    assert screen.end() == []


def test_carriage_return_overwrites_and_the_bar_is_final_once_left_alone():
    screen = Screen()
    screen.feed("\r 10%|#   |\r 50%|##  |\r100%|####|\n", 0.0)
    assert screen.take_final(0.0) == []  # redrawn: it might still come back
    assert screen.live() == ["100%|####|"]
    assert screen.take_final(HOLD) == ["100%|####|"]
    assert screen.live() == []


def test_a_shorter_redraw_keeps_the_end_of_the_longer_line_as_a_terminal_would():
    assert play("abcdef\rXY\n")[1] == ["XYcdef"]


def test_crlf_line_ends_are_plain_lines_even_split_between_reads():
    final, everything = play("one\r\ntwo\r", "\nthree\r\n")
    assert final == everything == ["one", "two", "three"]


def test_nested_tqdm_bars_replayed_from_tqdm_itself():
    tqdm = pytest.importorskip("tqdm").tqdm
    out = io.StringIO()
    outer = tqdm(total=3, desc="epoch", file=out, position=0, mininterval=0, ascii=True,
                 ncols=60)
    for _ in range(3):
        inner = tqdm(total=4, desc="batch", file=out, position=1, mininterval=0,
                     leave=False, ascii=True, ncols=60)
        for _ in range(4):
            inner.update()
        inner.close()
        outer.update()
    outer.close()
    raw = out.getvalue()
    assert "\x1b[A" in raw and "\r" in raw  # what a notebook cannot show as is
    # One character at a time and all at once give the same, and so does any split.
    for pieces in ([raw], list(raw), [raw[i:i + 7] for i in range(0, len(raw), 7)]):
        final, everything = play(*pieces, step=0.001)
        assert final == []  # the outer bar is revisited at each refresh of the inner one
        assert len(everything) == 1 and everything[0].startswith("epoch: 100%")
        assert "3/3" in everything[0]


def test_the_inner_bar_shows_live_below_the_outer_one():
    tqdm = pytest.importorskip("tqdm").tqdm
    out = io.StringIO()
    outer = tqdm(total=2, desc="epoch", file=out, position=0, mininterval=0, ncols=60)
    inner = tqdm(total=4, desc="batch", file=out, position=1, mininterval=0, ncols=60)
    inner.update(2)
    screen = Screen()
    screen.feed(out.getvalue(), 0.0)
    live = screen.live()
    assert [line.split(":")[0] for line in live] == ["epoch", "batch"]
    assert "2/4" in live[1]
    assert screen.cursor == 0  # tqdm keeps the cursor on its first bar
    inner.close()
    outer.close()


def test_a_line_printed_under_a_live_bar_is_held_then_final_in_order():
    screen = Screen()
    screen.feed("\rbar 1\rbar 2", 0.0)
    screen.feed("\r      \rsaid something\n\rbar 3", 0.1)  # tqdm.write: clear, print, redraw
    assert screen.take_final(0.2) == []
    assert screen.live() == ["said something", "bar 3"]
    assert screen.take_final(0.1 + HOLD) == ["said something"]
    assert screen.end() == ["bar 3"]


def test_erase_codes():
    assert play("hello world\r\x1b[Kbye\n")[1] == ["bye"]
    assert play("hello world\x1b[5D\x1b[K!\n")[1] == ["hello !"]
    assert play("hello world\r\x1b[2Kbye\n")[1] == ["bye"]
    assert play("hello world\x1b[6D\x1b[1K\n")[1] == ["      world"]
    assert play("a\nb\nc\x1b[2A\x1b[J\n")[1] == ["a"]  # from the cursor (after "a") on


def test_cursor_up_and_down_and_column():
    assert play("one\ntwo\n\x1b[2A\x1b[2CE\x1b[2B\n")[1] == ["onE", "two", ""]
    assert play("abc\x1b[1GX\x1b[5GY\n")[1] == ["Xbc Y"]
    assert play("a\nb\n\x1b[1FZ\n")[1] == ["a", "Z"]


def test_cursor_cannot_go_back_into_final_lines():
    final, everything = play("printed\n", "\x1b[5Aover\n")
    assert everything == ["printed", "over"]


def test_colours_are_kept_and_other_codes_dropped():
    text = "\x1b]0;title\x07\x1b[?25l\x1b[1;31mred\x1b[0m plain \x1b[32mgreen\x1b[m\n"
    (line,) = play(text)[1]
    assert line == "\x1b[1;31mred\x1b[0m plain \x1b[32mgreen\x1b[0m"
    assert not CURSOR_CODES.search(line)


def test_a_colour_overwritten_in_part_keeps_each_character_colour():
    (line,) = play("\x1b[31mabcd\x1b[0m\rXY\n")[1]
    assert line == "XY\x1b[31mcd\x1b[0m"


def test_escape_codes_split_between_reads_wait_for_their_end():
    final, everything = play("a\x1b", "[", "2", "K\rb\x1b]8;;http://x\x1b", "\\link\n")
    assert everything == ["blink"]


def test_a_lone_escape_and_other_controls_show_nothing():
    assert play("a\x1b\x07b\x00c\n")[1] == ["abc"]
    assert play("a\x1bcb\n")[1] == ["ab"]  # ESC c (a terminal reset) is a sequence of its own


def test_backspace_and_tabs():
    assert play("ab\bc\td\n")[1] == ["ac\td"]


def test_very_long_lines_wrap_at_the_width_kept():
    screen = Screen(width=100)
    screen.feed("x" * 250 + "\n" + "y" * 10, 0.0)
    assert screen.take_final(0.0) == ["x" * 100, "x" * 100, "x" * 50]
    assert screen.end() == ["y" * 10]


def test_many_plain_lines_are_cheap_and_in_order():
    text = "".join(f"line {i}\n" for i in range(100_000))
    screen = Screen()
    screen.feed(text, 0.0)
    final = screen.take_final(0.0)
    assert len(final) == 100_000 and final[0] == "line 0" and final[-1] == "line 99999"


def test_live_lines_are_bounded_by_the_height():
    screen = Screen(height=5)
    screen.feed("".join(f"\rline {i}\n" for i in range(20)), 0.0)  # each one redrawn
    final = screen.take_final(0.0)
    assert final == [f"line {i}" for i in range(16)]
    assert screen.live() == [f"line {i}" for i in range(16, 20)]  # and the cursor's, blank


# --- the tail: reading the log as it grows ---------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Collect:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


def test_tail_decodes_unicode_split_between_reads(tmp_path):
    log, sink = tmp_path / "rank0.log", Collect()
    tail = LogTail(log, sink)
    data = "héllo ✓ 🚀 done\n".encode()
    with open(log, "ab") as f:
        for i in range(len(data)):
            f.write(data[i:i + 1])
            f.flush()
            tail.pump()
    tail.close()
    assert sink.text == "héllo ✓ 🚀 done\n"


def test_tail_shows_only_its_cells_part_of_a_sessions_log(tmp_path):
    """A session's cell starts where the log ended, and stops where the next cell
    began, even while it still reads (the next cell's lines are not its own)."""
    log, sink = tmp_path / "rank-0.log", Collect()
    log.write_bytes(b"the cell before\n")
    ends: dict[int, int] = {}
    tail = LogTail(log, sink, start=log.stat().st_size, end=lambda: ends.get(0))
    with open(log, "ab") as f:
        f.write(b"this cell\n")
        f.flush()
        tail.pump()
        ends[0] = f.tell()
        f.write(b"the next cell\n")
    tail.close()
    assert sink.text == "this cell\n"


def test_tail_whose_end_is_known_as_it_first_looks_shows_nothing_past_it(tmp_path):
    """A quick session cell whose rank printed nothing said so (its log's end) before
    the tail first looked: a line a rank's thread wrote after that is the next cell's.
    A tail that shows it says how far it read, each time (the next cell begins there)."""
    log, sink = tmp_path / "rank-0.log", Collect()
    log.write_bytes(b"the cell before\n")
    start = log.stat().st_size
    read_to: list[int] = []
    quiet = LogTail(log, sink, start=start, end=lambda: start, shown=read_to.append)
    with open(log, "ab") as f:
        f.write(b"a thread, after the report\n")
    quiet.pump()
    quiet.close()
    assert sink.text == "" and read_to == []
    shown = LogTail(log, sink, start=start, shown=read_to.append)
    shown.pump()
    with open(log, "ab") as f:
        f.write(b"and more\n")
    shown.close()
    assert sink.text == "a thread, after the report\nand more\n"
    assert read_to == [start + 27, log.stat().st_size]


def test_tail_looked_at_before_its_cell_wrote_shows_what_comes_later(tmp_path):
    """A session cell's tail is pumped while its rank has written nothing yet (the log
    holds only earlier cells' lines), then the rank writes: that shows, once."""
    log, sink = tmp_path / "rank-0.log", Collect()
    log.write_bytes(b"the cell before\n")
    tail = LogTail(log, sink, start=log.stat().st_size)
    for _ in range(3):
        tail.pump()
    assert sink.text == ""
    with open(log, "ab") as f:
        f.write(b"at last\n")
    tail.pump()
    tail.close()
    assert sink.text == "at last\n"


def test_tail_of_a_bar_writes_no_line_per_refresh_and_no_code(tmp_path):
    log, sink, clock = tmp_path / "rank0.log", Collect(), Clock()
    tail = LogTail(log, sink, clock=clock)
    with open(log, "a") as f:
        f.write("starting\n")
        for i in range(101):
            f.write(f"\rtraining {i:3d}%")
            f.flush()
            tail.pump()
            clock.now += 0.05  # 5 s in all: no snapshot yet
        f.write("\ndone\n")
    tail.close()
    assert sink.text == "starting\ntraining 100%\ndone\n"


def test_tail_in_text_output_snapshots_a_long_bar_now_and_then(tmp_path):
    log, sink, clock = tmp_path / "rank0.log", Collect(), Clock()
    tail = LogTail(log, sink, clock=clock)
    with open(log, "a") as f:
        for i in range(60):
            f.write(f"\rstep {i}")
            f.flush()
            tail.pump()
            clock.now += 1.0
        f.write("\n")
    tail.close()
    lines = sink.text.splitlines()
    assert lines[-1] == "step 59"
    assert 4 <= len(lines) <= 7  # one every 10 s, and the final one
    assert "\r" not in sink.text


def test_tail_with_a_prefix_prefixes_final_lines_and_the_partial_one(tmp_path):
    log, sink = tmp_path / "rank1.log", Collect()
    tail = LogTail(log, sink, prefix="[rank 1] ")
    log.write_text("hello\n\rbar 1\rbar 2\nno newline")
    tail.pump()
    assert sink.text == "[rank 1] hello\n"
    tail.close()
    assert sink.text == "[rank 1] hello\n[rank 1] bar 2\n[rank 1] no newline\n"


def test_bounded_output_still_caps_what_the_tail_writes(tmp_path):
    log = tmp_path / "rank0.log"
    shown = []
    bounded = BoundedOutput(shown.append, log, max_lines=10, tail_lines=3)
    tail = LogTail(log, bounded)
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    tail.close()
    bounded.close()
    text = "".join(shown)
    assert "line 9\n" in text and "line 10\n" not in text.split("[nbddp]")[1]
    assert "90 lines not shown; the last 3:\nline 97\nline 98\nline 99\n" in text


class Handle:
    """An IPython display handle, as the display machinery keeps it."""

    def __init__(self, shown: list[Handle], data: dict) -> None:
        self.data = data
        shown.append(self)

    def update(self, data: dict, raw: bool) -> None:
        self.data = data


@pytest.fixture
def displays(monkeypatch):
    """Displays made under the "cell", with what each shows now."""
    import IPython.display

    shown: list[Handle] = []
    monkeypatch.setattr(IPython.display, "display",
                        lambda data, raw, display_id: Handle(shown, data))
    return shown


def test_displayed_lines_update_one_display_in_place(displays, tmp_path):
    log, sink, clock = tmp_path / "rank0.log", Collect(), Clock()
    tail = LogTail(log, sink, in_place=True, clock=clock)
    with open(log, "a") as f:
        f.write("before\n")
        for i in range(50):
            f.write(f"\rbar {i}")
            f.flush()
            tail.pump()
            clock.now += 0.05
            shown = int(displays[-1].data["text/plain"].split()[1])
            assert i - 2 <= shown <= i  # ten updates a second at most
        f.write("\n")
    clock.now += HOLD
    tail.pump()
    tail.close()
    assert len(displays) == 1
    assert displays[0].data["text/plain"] == "bar 49"  # the bar's last state stays there
    assert sink.text == "before\n"


def test_a_line_read_before_its_end_goes_below_as_a_line_not_into_a_display(displays,
                                                                           tmp_path):
    log, sink, clock = tmp_path / "rank0.log", Collect(), Clock()
    tail = LogTail(log, sink, in_place=True, clock=clock)
    with open(log, "a") as f:
        f.write("work")  # the rank's write, read in two pieces
        f.flush()
        tail.pump()
        clock.now += 0.05
        f.write("ing\n")
        f.flush()
        tail.pump()
    assert sink.text == "working\n" and not displays
    with open(log, "a") as f:
        f.write("loading... ")  # left unfinished for a while: shown in place, then
        f.flush()
        tail.pump()
        clock.now += HOLD
        tail.pump()
    assert [d.data["text/plain"] for d in displays] == ["loading..."]


def test_displayed_lines_go_below_when_lines_were_written_under_the_display(displays):
    sink = Collect()
    lines = DisplayedLines(sink)
    lines.update(["a"], ["bar 1"], 0, 0.0)
    lines.update(["printed"], ["bar 2"], 0, 1.0)
    lines.update(["bar 3"], [], 0, 2.0)
    assert sink.text == "a\nprinted\nbar 3\n"
    assert [d.data["text/plain"] for d in displays] == [""]  # emptied, nothing left in it
    lines.update([], ["next bar"], 0, 3.0)
    assert len(displays) == 2  # the next bar shows below what was written


def test_a_long_live_line_is_clipped_without_cutting_a_colour_code(displays):
    lines = DisplayedLines(Collect())
    lines.update([], ["x" * 998 + "\x1b[31mred" + "y" * 100], 0, 0.0)
    shown = displays[0].data["text/plain"]
    assert shown == "x" * 998 + "…"
    lines.update([], ["\x1b[1m" + "z" * 2000], 0, 1.0)
    assert displays[0].data["text/plain"] == "\x1b[1m" + "z" * 996 + "\x1b[0m…"


def test_snapshot_lines_only_from_the_cursor_down():
    sink = Collect()
    lines = SnapshotLines(sink, every=10)
    lines.update([], ["left above", "bar 1"], 1, 0.0)
    lines.update([], ["left above", "bar 2"], 1, 10.0)
    lines.update([], ["left above", "bar 2"], 1, 20.0)  # unchanged: not again
    assert sink.text == "bar 2\n"
