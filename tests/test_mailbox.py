"""Mailbox files: a SLURM rank's messages through the shared filesystem.

Real files, a real writer and the kernel's real reader: only reports are forced to disk;
a frame torn by a killed rank costs that message alone, however many follow it; a frame
still being written is waited for. Then the pure framing, cut at every byte.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from nbddp._wire import mailbox as _mailbox
from nbddp._wire.frames import decode
from nbddp._wire.mailbox import MailboxReader, MailboxWriter, frame, mailbox_path, split
from nbddp._wire.messages import (
    Failure,
    Hello,
    Metrics,
    Requeueing,
    Result,
    Sequenced,
    StopRequested,
)
from nbddp._wire.rank_stats import RankStats

from .conftest import wait_until

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


def chatter(seq: int, attempt: int = 0) -> Sequenced:
    """A rank's metrics, as it sends them about ten times a second."""
    return Sequenced(seq, Metrics(0, [(seq, {"loss": float(seq)})]), attempt)


def written(folder: Path, *messages: object) -> bytes:
    """What a rank's real writer puts in its file for ``messages``."""
    path = folder / "scratch.messages"
    writer = MailboxWriter(path)
    for message in messages:
        writer.send(message)
    writer.close()
    data = path.read_bytes()
    path.unlink()
    return data


def append(path: Path, *messages: object) -> None:
    writer = MailboxWriter(path)
    for message in messages:
        writer.send(message)
    writer.close()


@pytest.fixture
def reader(tmp_path):
    got: list[object] = []
    reader = MailboxReader(tmp_path, 1, got.append)
    reader.got = got  # type: ignore[attr-defined]
    yield reader
    reader.close()


# --- what is forced to disk -----------------------------------------------------------


def test_only_reports_are_forced_to_disk(tmp_path, monkeypatch, reader):
    """Metrics and stats go out ten times a second per rank: an fsync each is a load on
    the shared filesystem's servers. Results, failures and requeues are synced."""
    real_fsync, synced = os.fsync, []
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    everyday = [Sequenced(0, Hello(0, 42)), chatter(1),
                Sequenced(2, RankStats(0, "n1", 42, 1, 512.0, None, 100)),
                Sequenced(3, StopRequested(0))]
    reports = [Sequenced(4, Result(0, b"value")),
               Sequenced(5, Failure(0, "ValueError", "builtins", "bad", "Traceback...")),
               Sequenced(6, Requeueing(0))]
    writer = MailboxWriter(mailbox_path(tmp_path, 0))
    for message in everyday * 10:
        writer.send(message)
    assert synced == []
    for report in reports:
        writer.send(report)
        assert len(synced) == reports.index(report) + 1
    writer.close()
    reader.poll()
    assert reader.got == everyday * 10 + reports


# --- torn frames ----------------------------------------------------------------------


def test_a_frame_torn_by_a_killed_rank_costs_only_that_message(tmp_path, reader, caplog):
    """A rank killed half way through a message, then its requeued attempt appending to
    the same file: every whole message arrives, with one warning."""
    path = mailbox_path(tmp_path, 0)
    first = [chatter(seq) for seq in range(3)]
    append(path, *first)
    torn = written(tmp_path, Sequenced(3, Result(0, b"x" * 1000)))
    with open(path, "ab") as f:
        f.write(torn[:len(torn) // 2])  # the rank was killed here
    caplog.set_level(logging.WARNING, logger="nbddp._wire.mailbox")
    reader.poll()
    assert reader.got == first and not caplog.records  # maybe still being written
    later = [chatter(seq, attempt=1) for seq in range(3)] + [
        Sequenced(3, Result(0, b"done"), attempt=1)]
    append(path, *later)  # the next attempt
    wait_until(lambda: len(reader.got) == len(first + later), timeout=10)
    assert reader.got == first + later
    assert len(caplog.records) == 1, caplog.text
    assert f"skipped {len(torn) // 2} bytes" in caplog.text and str(path) in caplog.text


def test_a_frame_that_looks_torn_is_given_a_moment_and_the_last_read_skips_it(
        tmp_path, caplog):
    """A shared filesystem may show a later write before an earlier one: a torn-looking
    frame is skipped only after ``TORN_GRACE``, or at once by the final read."""
    path = mailbox_path(tmp_path, 0)
    whole = written(tmp_path, chatter(0))
    path.write_bytes(b"\0" * 40 + whole)  # not yet shown: zeros before a whole frame
    got: list[object] = []
    reader = MailboxReader(tmp_path, 1, got.append)
    reader.poll()
    assert got == []  # within the grace
    reader.close()  # the ranks are gone: skipped now
    assert got == [chatter(0)] and "skipped 40 bytes at offset 0" in caplog.text


def test_a_message_still_being_written_is_waited_for(tmp_path, reader, caplog):
    path = mailbox_path(tmp_path, 0)
    data = written(tmp_path, chatter(0), chatter(1))
    for cut in (5, len(data) // 3, len(data) - 1, len(data)):
        with open(path, "ab") as f:
            f.write(data[path.stat().st_size if path.exists() else 0:cut])
        reader.poll()
        assert reader.got == [chatter(0), chatter(1)][:len(split(data[:cut])[0])]
    assert reader.got == [chatter(0), chatter(1)] and not caplog.records


# --- the framing ----------------------------------------------------------------------


def test_a_cut_stream_gives_its_whole_frames_and_is_never_torn():
    messages = [chatter(0), Sequenced(1, Result(0, b"v" * 300)), chatter(2)]
    data = b"".join(frame(m) for m in messages)
    for cut in range(len(data) + 1):
        bodies, used, torn = split(data[:cut])
        assert torn is None and used <= cut
        assert [decode(b) for b in bodies] == messages[:len(bodies)]
        assert used == sum(len(frame(m)) for m in messages[:len(bodies)])


def test_a_flipped_byte_or_missing_bytes_are_a_torn_span_before_the_next_whole_frame():
    one, two, three = (frame(chatter(seq)) for seq in range(3))
    flipped = two[:-5] + bytes([two[-5] ^ 0xFF]) + two[-4:]  # a bad checksum
    for middle in (flipped, two[:20], two[:7], b"garbage" * 30):
        bodies, used, torn = split(one + middle + three)
        assert [decode(b) for b in bodies] == [chatter(0)]
        assert (used, torn) == (len(one), len(middle))
        bodies, used, torn = split(three)  # what the reader reads after skipping it
        assert [decode(b) for b in bodies] == [chatter(2)] and torn is None
    assert split(one + flipped) == ([one[_mailbox._HEAD.size:]], len(one), None)  # waits
