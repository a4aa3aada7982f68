"""The records folders: the newest runs are kept, a SLURM job's folder while it may run."""

from __future__ import annotations

import pytest

from nbddp._run import records
from nbddp._run.records import KEEP_RUNS, PRUNE_EVERY, Records

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


def new_records_dir():
    return Records.create().path


def test_only_the_newest_runs_are_kept_but_never_a_live_jobs_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("NBDDP_RUNS_DIR", str(tmp_path))
    monkeypatch.setattr(records, "_created", 0)
    live_job = new_records_dir()
    (live_job / "payload.pkl").write_bytes(b"the job may still be running")
    finished = new_records_dir()
    newer = [new_records_dir() for _ in range(KEEP_RUNS + PRUNE_EVERY - 1)]  # (the last
    assert live_job.exists(), "a folder whose job may still run was pruned"  # prunes)
    assert not finished.exists()
    assert all(path.exists() for path in newer[-KEEP_RUNS:])
    assert len(records.folders(tmp_path)) == KEEP_RUNS + 1  # and the live one
    assert (live_job.stat().st_mode & 0o777) == 0o700


def _nothing() -> None:
    return None


def test_a_sessions_cells_keep_only_the_newest_runs_records(tmp_path, monkeypatch):
    """A session removes old records while its ranks run a cell: as many are kept as
    for launches, and the runs that just ended keep theirs."""
    import nbddp

    monkeypatch.setenv("NBDDP_RUNS_DIR", str(tmp_path))
    with nbddp.Session(2, output="none") as session:
        jobs = []
        for _ in range(2 * (KEEP_RUNS + PRUNE_EVERY)):
            jobs.append(session.submit(_nothing))
            jobs[-1].result()
    kept = records.folders(tmp_path)
    assert KEEP_RUNS <= len(kept) <= KEEP_RUNS + PRUNE_EVERY, f"{len(kept)} folders kept"
    assert [job.records for job in jobs[-KEEP_RUNS:]] == kept[-KEEP_RUNS:]
    assert not jobs[0].records.exists()
    assert (kept[-1] / "rank-1.log").exists()
