"""The records folders: the newest runs are kept, a SLURM job's folder while it may run."""

from __future__ import annotations

import shutil
from pathlib import Path

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


def _say(text: str, step: int) -> None:
    import nbddp

    print(f"{text} from rank", __import__("torch.distributed").distributed.get_rank())
    print("a line without its end", end="")
    nbddp.log(step=step, loss=float(step))


def test_a_sessions_cells_share_one_folder_each_with_its_own_logs_and_metrics(
        tmp_path, monkeypatch):
    """A session's cells write in one folder (nothing made per cell), and each job still
    shows its own cell's output, metrics and folder."""
    import nbddp

    monkeypatch.setenv("NBDDP_RUNS_DIR", str(tmp_path))
    with nbddp.Session(2, output="none") as session:
        first = session.submit(_say, ("first", 1))
        first.result()
        second = session.submit(_say, ("second", 2))
        second.result()
        assert first.records == second.records
        folder = first.records
        assert records.folders(tmp_path) == [folder]
        assert "first from rank 1" in first.logs[1] and "second" not in first.logs[1]
        assert "first" not in second.logs[1] and "second from rank 1" in second.logs[1]
        assert first.logs[0].endswith("a line without its end")  # flushed with its cell
        assert [row["loss"] for row in first.history] == [1.0]
        assert [row["loss"] for row in second.history] == [2.0]
        assert {"metrics-1.jsonl", "metrics-2.jsonl"} <= {p.name for p in folder.iterdir()}
        log = (folder / "rank-1.log").read_text()
        assert log.index("first from rank 1") < log.index("second from rank 1")
    assert not (folder / records.LIVE_LOCK).exists()


def test_a_live_sessions_folder_is_never_pruned_and_an_ended_ones_is(tmp_path, monkeypatch):
    """Other runs prune the oldest folders; a session's, however old, stays while the
    session lives, here or in another kernel, and goes like any run's once it ended."""
    import nbddp

    monkeypatch.setenv("NBDDP_RUNS_DIR", str(tmp_path))
    with nbddp.Session(2, output="none") as session:
        session.run(_nothing)
        job = session.submit(_nothing)
        job.result()
        folder = job.records
        for _ in range(KEEP_RUNS + 1):
            new_records_dir()
        records._prune(tmp_path)  # as another kernel's launch would
        assert folder.exists(), "a live session's records were pruned"
        session.run(_say, "still", 3)
    records._prune(tmp_path)
    assert not folder.exists()


def test_a_killed_kernels_session_folder_can_be_pruned(tmp_path, monkeypatch):
    """The lock that keeps a session's folder goes with its kernel, however it ends."""
    import subprocess
    import sys

    monkeypatch.setenv("NBDDP_RUNS_DIR", str(tmp_path))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from nbddp._run.records import SessionRecords;"
         "print(SessionRecords(2).next_cell(1).path, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        folder = Path(holder.stdout.readline().strip())
        for _ in range(KEEP_RUNS + 1):
            new_records_dir()
        records._prune(tmp_path)
        assert folder.exists(), "a live session's records were pruned"
    finally:
        holder.kill()
        holder.wait()
        holder.stdin.close()
        holder.stdout.close()
    records._prune(tmp_path)
    assert not folder.exists()


def test_a_session_whose_folder_was_removed_writes_in_a_new_one(tmp_path, monkeypatch):
    """Someone cleans the records folder while a session lives: its next cell still runs,
    and its output is kept in a new folder."""
    import nbddp

    monkeypatch.setenv("NBDDP_RUNS_DIR", str(tmp_path))
    with nbddp.Session(2, output="none") as session:
        first = session.submit(_say, ("first", 1))
        first.result()
        shutil.rmtree(first.records)
        second = session.submit(_say, ("second", 2))
        second.result()
        assert second.records != first.records
        assert "second from rank 1" in second.logs[1]
        assert [row["loss"] for row in second.history] == [2.0]


def test_a_long_session_moves_to_a_new_folder(tmp_path, monkeypatch):
    """After ``CELLS_PER_FOLDER`` cells the session writes in a new folder, and the old
    one is released to be pruned like any run's."""
    monkeypatch.setenv("NBDDP_RUNS_DIR", str(tmp_path))
    monkeypatch.setattr(records, "CELLS_PER_FOLDER", 2)
    cells = records.SessionRecords(2)
    try:
        paths = [cells.next_cell(number).path for number in range(1, 6)]
    finally:
        cells.close()
    assert paths[0] == paths[1] != paths[2] == paths[3] != paths[4]
    assert not any((path / records.LIVE_LOCK).exists() for path in paths)


def test_a_cells_part_of_each_log_ends_where_its_rank_said_it_reached(tmp_path, monkeypatch):
    """Each rank says, as it reports, how far its log reached: the cell's part ends there
    and the next cell's begins there, without a look at every rank's log. What a rank's
    thread writes after its report is the next cell's (or, where nbddp already showed
    it under this cell, this one's); a cell that a rank did not report on is measured."""
    monkeypatch.setenv("NBDDP_RUNS_DIR", str(tmp_path))
    cells = records.SessionRecords(2)
    try:
        first = cells.next_cell(1)
        for rank, text in enumerate((b"cell one\n", b"cell one, rank 1\n")):
            with open(first.rank_log(rank), "ab") as log:
                log.write(text)
            first.reached(rank, len(text))
        assert (first.log_end(0), first.log_end(1)) == (9, 17)
        with open(first.rank_log(0), "ab") as log:
            log.write(b"a thread, after the report\n")
        second = cells.next_cell(2)
        assert (second.log_start(0), second.log_start(1)) == (9, 17)
        assert first.read_logs(2) == {0: "cell one\n", 1: "cell one, rank 1\n"}
        second.reached(0, 9)
        second.reached(1, 17)
        second.shown(0, 9 + 27)  # (rank 0's tail showed the thread's line under this cell)
        third = cells.next_cell(3)
        assert (third.log_start(0), third.log_start(1)) == (36, 17)
        third.reached(0, 36)  # rank 1 never reported: its log is measured
        for rank, text in enumerate((b"rank 0's thread\n", b"rank 1, late\n")):
            with open(first.rank_log(rank), "ab") as log:
                log.write(text)
        fourth = cells.next_cell(4)
        assert (fourth.log_start(0), fourth.log_start(1)) == (36, 17 + 13)
        assert third.read_logs(2) == {0: "", 1: "rank 1, late\n"}
        assert fourth.read_logs(2)[0] == "rank 0's thread\n"  # (shown under the next cell)
    finally:
        cells.close()


def test_a_folder_whose_lock_cannot_be_asked_about_is_kept(tmp_path, monkeypatch):
    """A file system without locks (or a broken one) cannot say whether a session still
    writes in a folder: it is kept, and the pruning goes on with the others."""
    import errno
    import fcntl

    monkeypatch.setenv("NBDDP_RUNS_DIR", str(tmp_path))
    unknown = Records.create(forget_old=False).path
    (unknown / records.LIVE_LOCK).write_bytes(b"")
    finished = Records.create(forget_old=False).path
    for _ in range(KEEP_RUNS):
        Records.create(forget_old=False)

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "no locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    records._prune(tmp_path)
    assert unknown.exists() and not finished.exists()


@pytest.mark.parametrize("nprocs, make_logs", [(2, True), (records.MAKE_LOGS_UP_TO + 1, True),
                                               (2, False)])
def test_a_cluster_cells_folder_has_its_ranks_logs_made_ahead_only_for_a_few_ranks(
        tmp_path, monkeypatch, nprocs, make_logs):
    """Thousands of ranks' logs made by the kernel for every cell (and pruned later) would
    be its largest cost; past MAKE_LOGS_UP_TO each rank makes its own (on its node), as
    it opens it; where the kernel writes what the ranks send (Ray), none is made ahead."""
    monkeypatch.setenv("NBDDP_RUNS_DIR", str(tmp_path / "runs"))
    cells = records.FolderPerCell(nprocs, make_logs)
    cells.prepare()
    cell = cells.next_cell(1)
    made = sorted(p.name for p in cell.path.iterdir() if p.name.endswith(".log"))
    if make_logs and nprocs <= records.MAKE_LOGS_UP_TO:
        assert made == sorted(cell.rank_log(r).name for r in range(nprocs))
    else:
        assert made == []
        cell.rank_log(1).write_text("rank 1 made its own\n")
        assert cell.read_logs(nprocs)[1] == "rank 1 made its own\n"
        assert cell.read_logs(nprocs)[0] == ""  # (a rank that wrote nothing: empty)
    cells.close()
