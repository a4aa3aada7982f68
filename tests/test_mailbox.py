"""Mailbox files: a SLURM rank's messages through the shared filesystem.

Real files, a real writer and the kernel's real reader: only reports are forced to disk.
"""

from __future__ import annotations

import os

import pytest

from nbddp._mailbox import MailboxReader, MailboxWriter, mailbox_path
from nbddp._messages import (
    Failure,
    Hello,
    Metrics,
    RankStats,
    Requeueing,
    Result,
    Sequenced,
    StopRequested,
)


def chatter(seq: int, attempt: int = 0) -> Sequenced:
    """A rank's metrics, as it sends them about ten times a second."""
    return Sequenced(seq, Metrics(0, [(seq, {"loss": float(seq)})]), attempt)


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
