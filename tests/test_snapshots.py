"""Session snapshots: a rank that dies costs the cell in flight, not the session.

The ranks keep their names after each cell in shared memory (``_rank.snapshot``); the
kernel keeps the folder and says what fresh ranks restore (``_run.session.snapshots``).
The kernel tests kill ranks as the OOM killer would (SIGKILL), between cells and in
one, and check that every rank comes back with its own values and that training goes on.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from nbddp._rank.relay_compact import compact
from nbddp._rank.scope import Scope
from nbddp._rank.snapshot import Snapshots
from nbddp._run.session.snapshots import SessionSnapshots, parse_size
from nbddp._wire.messages import Result, Sequenced, SnapshotTaken
from nbddp._wire.relay_messages import RanksFinished
from nbddp._wire.snapshot_orders import (
    RestoreNote,
    RestoreOrder,
    SnapshotNote,
    SnapshotOrder,
    snapshot_files,
)

from .conftest import SHM, descendants, wait_until
from .kernel_driver import Kernel
from .test_kernel import _alive, _snapshot
from .test_session import cell, session_pids

# --- the rank's side and the kernel's, in this process ------------------------------------


def _scope(**names) -> Scope:
    scope = Scope()
    scope.globals.update(names)
    scope.assigned |= set(names)
    return scope


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.fast
def test_a_rank_s_names_come_back_whole_shared_as_they_were_and_its_rng_too(tmp_path):
    model, opt = _trained()
    lock = threading.Lock()
    held = Snapshots(rank=1)
    note = held.keep(_scope(model=model, opt=opt, shard=torch.arange(5), lock=lock),
                     SnapshotOrder(str(tmp_path), cell=3), ran=True)
    assert [name for name, _ in note.skipped] == ["lock"]
    assert "cannot pickle" in note.skipped[0][1]
    expected = torch.rand(3, generator=torch.Generator().set_state(torch.get_rng_state()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1-cell3.manifest",
                                                           "rank1-cell3.snapshot"]
    torch.rand(10)  # (the RNG moves on; the snapshot's does not)

    fresh = Scope()
    restored = Snapshots(rank=1).restore(fresh, RestoreOrder(str(tmp_path), cell=3))
    assert restored.names == ("model", "opt", "shard") and restored.size > 0
    assert fresh.assigned == {"model", "opt", "shard"}
    back, back_opt = fresh.globals["model"], fresh.globals["opt"]
    assert back_opt.param_groups[0]["params"][0] is back.weight  # shared, as before
    assert torch.equal(back.weight, model.weight)
    assert torch.equal(back_opt.state[back.weight]["momentum_buffer"],
                       opt.state[model.weight]["momentum_buffer"])
    assert torch.equal(fresh.globals["shard"], torch.arange(5))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.fast
def test_a_rank_keeps_its_newest_snapshot_and_the_cell_the_kernel_keeps(tmp_path):
    """Cell 2 failed on another rank: the kernel keeps cell 1, so this rank does too; a
    rank the cell did not run on links its last file under the new cell."""
    held = Snapshots(rank=0)
    for number, keep in ((1, 0), (2, 1), (3, 1)):
        assert held.keep(_scope(n=number), SnapshotOrder(str(tmp_path), number, keep),
                         ran=True).written
    assert sorted(snapshot_files(tmp_path)) == [1, 3]
    held.keep(_scope(n=99), SnapshotOrder(str(tmp_path), 4, 3), ran=False)
    files = snapshot_files(tmp_path)
    assert sorted(files) == [3, 4] and os.path.samefile(files[3][0], files[4][0])


@pytest.mark.fast
def test_a_rank_whose_last_cell_kept_no_snapshot_does_not_stand_on_an_older_one(tmp_path):
    """Cell 2 ran here and its snapshot was over the cap: for cell 3, run on other ranks
    only, this rank's state is pickled afresh, not its cell-1 file linked."""
    held, scope = Snapshots(rank=0), _scope(n=1)
    assert held.keep(scope, SnapshotOrder(str(tmp_path), 1, 0), ran=True).written
    scope.globals["n"] = 2
    assert held.keep(scope, SnapshotOrder(str(tmp_path), 2, 1, max_bytes=10), ran=True
                     ).too_large
    assert held.keep(scope, SnapshotOrder(str(tmp_path), 3, 1), ran=False).written
    files = snapshot_files(tmp_path)
    assert not os.path.samefile(files[1][0], files[3][0])
    fresh = Scope()
    Snapshots(rank=0).restore(fresh, RestoreOrder(str(tmp_path), cell=3))
    assert fresh.globals["n"] == 2


def _parts(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("rank0-part*.bin"))


@pytest.mark.fast
def test_a_large_tensor_unchanged_is_not_written_again(tmp_path):
    """Its part file is named by the next snapshot as it is; written in place, through
    the tensor or behind its version counter (``.data``), it gets a new part. Parts no
    kept snapshot names are removed."""
    big = torch.zeros(2**21)  # 8 MiB: a part of its own
    scope = _scope(big=big, small=torch.ones(3))
    held = Snapshots(rank=0)

    def snapshot(number: int) -> list[str]:
        held.keep(scope, SnapshotOrder(str(tmp_path), number, number - 1), ran=True)
        return _parts(tmp_path)

    first = snapshot(1)
    assert len(first) == 1
    part = tmp_path / first[0]
    written = part.stat().st_mtime_ns, part.stat().st_ino
    assert snapshot(2) == first and (part.stat().st_mtime_ns, part.stat().st_ino) == written
    big[0] = 1.0  # (through the tensor: its version counter moves)
    changed = snapshot(3)
    assert len(changed) == 2 and first[0] in changed  # (cell 2, kept, still names it)
    assert snapshot(4) == [name for name in changed if name != first[0]]
    big.data[1] = 2.0  # (behind the counter; one place: the samples may miss it)
    big.data[:] = 5.0  # (behind the counter, all of it: the samples see it)
    assert first[0] not in snapshot(5) and len(_parts(tmp_path)) == 2
    fresh = Scope()
    Snapshots(rank=0).restore(fresh, RestoreOrder(str(tmp_path), cell=5))
    assert torch.equal(fresh.globals["big"], torch.full((2**21,), 5.0))


@pytest.mark.fast
def test_a_changed_tensor_is_written_over_a_part_no_snapshot_keeps_but_not_a_mapped_one(
        tmp_path):
    """Cells 1 to 3 change an 8 MiB tensor: cell 3's part is cell 1's file written over
    (cell 2 is kept). Fresh ranks restore cell 3 and map its part: once no snapshot keeps
    it, the next new part goes into a new file, and the restored tensor keeps its values."""
    a = torch.zeros(2**21)  # 8 MiB: a part of its own
    held = Snapshots(rank=0)
    files = {}
    for number in (1, 2, 3):
        a.fill_(number)
        held.keep(_scope(a=a), SnapshotOrder(str(tmp_path), number, number - 1), ran=True)
        files[number] = {p.stat().st_ino for p in tmp_path.glob("rank0-part*.bin")}
    assert len(files[2]) == 2 and files[3] == files[2]  # (cell 1's file holds cell 3's)

    fresh, again = Scope(), Snapshots(rank=0)
    again.restore(fresh, RestoreOrder(str(tmp_path), cell=3))
    restored, c = fresh.globals["a"], torch.full((2**21,), 9.0)
    fresh.globals["c"] = c
    fresh.assigned.add("c")
    again.keep(fresh, SnapshotOrder(str(tmp_path), 4, 3), ran=True)
    c.fill_(10.0)  # (a new part for c; cell 3's, mapped by a, is free to go)
    again.keep(fresh, SnapshotOrder(str(tmp_path), 5, 4), ran=True)
    assert torch.equal(restored, torch.full((2**21,), 3.0))
    back = Scope()
    Snapshots(rank=0).restore(back, RestoreOrder(str(tmp_path), cell=5))
    assert torch.equal(back.globals["a"], restored) and torch.equal(back.globals["c"], c)


@pytest.mark.fast
def test_a_snapshot_copied_to_another_folder_loads_whole_from_there(tmp_path):
    """As a node's copy of another node's snapshot: its parts are found beside it, and
    the folder it was written in may be gone."""
    import shutil

    written, copied = tmp_path / "node1", tmp_path / "node2"
    written.mkdir(mode=0o700)
    big, small = torch.arange(2**21, dtype=torch.float32), torch.ones(3)  # (8 MiB: a part)
    Snapshots(rank=0).keep(_scope(big=big, small=small), SnapshotOrder(str(written), 1),
                           ran=True)
    assert _parts(written)
    shutil.copytree(written, copied)
    shutil.rmtree(written)
    fresh = Scope()
    Snapshots(rank=0).restore(fresh, RestoreOrder(str(copied), cell=1))
    assert torch.equal(fresh.globals["big"], big)
    assert torch.equal(fresh.globals["small"], small)


@pytest.mark.fast
def test_a_snapshot_naming_a_part_outside_its_folder_is_not_loaded(tmp_path):
    """A part is named by its file's name: a path out of the folder is refused."""
    from nbddp._rank.snapshot_parts import _mapped_part, parts_loaded

    outside = tmp_path / "outside.bin"
    outside.write_bytes(bytes(16))
    (tmp_path / "folder").mkdir()
    with parts_loaded(tmp_path / "folder"):
        for name in (str(outside), "../outside.bin", ".hidden", ""):
            with pytest.raises(RuntimeError, match="is not the name of a snapshot's part"):
                _mapped_part(name, 16)
    with pytest.raises(RuntimeError, match="loaded only with its snapshot"):
        _mapped_part("outside.bin", 16)


@pytest.mark.fast
def test_a_snapshot_over_the_rank_s_share_of_the_cap_is_not_kept(tmp_path):
    held = Snapshots(rank=0)
    note = held.keep(_scope(big=torch.zeros(2**21)),
                     SnapshotOrder(str(tmp_path), 1, 0, max_bytes=2**20), ran=True)
    assert note.too_large > 8 * 2**20 and not note.written and not list(tmp_path.iterdir())


@pytest.mark.fast
@pytest.mark.parametrize(("given", "nbytes"), [
    (4096, 4096), ("512MiB", 512 * 2**20), ("8GiB", 8 * 2**30), ("8G", 8 * 2**30),
    ("1.5 GB", 3 * 2**29), ("64k", 2**16)])
def test_a_snapshot_cap_is_a_size(given, nbytes):
    assert parse_size(given) == nbytes


@pytest.mark.fast
@pytest.mark.parametrize("given", ["lots", "0", -5, "8 parsecs", True])
def test_a_snapshot_cap_that_is_no_size_is_refused(given):
    with pytest.raises(ValueError, match="snapshot cap"):
        parse_size(given)


def _kept(snapshots: SessionSnapshots, folder: Path, number: int, ranks, **names) -> None:
    """Cell ``number`` as ``ranks`` keep it (their files written), then as the kernel
    sees its end: on every rank of the session."""
    notes = {}
    for rank in ranks:
        held = Snapshots(rank)
        notes[rank] = held.keep(_scope(**names), SnapshotOrder(str(folder), number,
                                                                number - 1), ran=True)
    snapshots.ended(number, True, frozenset(names))
    snapshots.noted([SnapshotTaken(rank, note) for rank, note in notes.items()])


@pytest.mark.fast
def test_fresh_ranks_restore_the_newest_cell_every_rank_has_and_the_notebook_is_told(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NBDDP_SHM_DIR", str(tmp_path))
    snapshots = SessionSnapshots(nprocs=2)
    snapshots.turn_on()
    try:
        folder = snapshots.folder
        assert folder is not None and folder.parent == tmp_path
        assert folder.stat().st_mode & 0o777 == 0o700
        assert 0 < snapshots.max_bytes < os.sysconf("SC_PAGE_SIZE") * os.sysconf(
            "SC_PHYS_PAGES")  # (a quarter of the memory free)
        assert snapshots.order(1) == SnapshotOrder(str(folder), 1, 0, snapshots.max_bytes // 2)
        _kept(snapshots, folder, 1, [0, 1], x=1, y=2)
        _kept(snapshots, folder, 2, [0, 1], x=1, lock=threading.Lock())
        assert "cannot keep lock (TypeError" in capsys.readouterr().err
        _kept(snapshots, folder, 3, [0], x=3)  # (rank 1 died writing cell 3's)
        assert snapshots.order(4).keep == 2  # (the newest every rank said it wrote)
        said = snapshots.when_lost(cell_lost=True)
        assert said is not None and said.startswith(
            "the session restarted on new ranks, which restore 1 name from cell 2 ("), said
        assert said.endswith("first; the cell that was running is lost; not restored: "
                             "lock (TypeError: cannot pickle '_thread.lock' object)"), said
        assert snapshots.restoring == RestoreOrder(str(folder), 2)
        assert re.search(r"snapshots on \(at most .+\): cell 2, rank 0 .*, rank 1 ",
                         snapshots.status())  # (cell 3: none of the fresh ranks has it)
    finally:
        snapshots.turn_off()
    assert not folder.exists() and snapshots.status() == "snapshots off"


@pytest.mark.fast
def test_what_a_rank_says_of_its_snapshot_crosses_a_relay_as_its_own():
    """A node's relay says plain ends once for many ranks: a snapshot's note, and an end
    that carries what a rank restored, go as the rank's own."""
    noted = Sequenced(5, SnapshotTaken(0, SnapshotNote(4, (("lock", "TypeError"),))))
    restored = Sequenced(4, Result(1, restored=RestoreNote(3, ("x",), 10)))
    plain = [Sequenced(4, Result(rank)) for rank in (2, 3)]
    said = compact([noted, restored, *plain, None])
    assert noted in said and restored in said
    assert [m.ranks for m in said if isinstance(m, RanksFinished)] == [(2, 3)]


KEEPING_KERNEL = """
import sys, time
from nbddp._run.session.snapshots import SessionSnapshots, parse_size
snapshots = SessionSnapshots(2)
snapshots.turn_on()
print(snapshots.folder, snapshots._keeper.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.fast
def test_a_kernel_killed_leaves_no_snapshot_behind(tmp_path):
    """The kernel is killed (no clean-up of its own runs): its keeper removes the
    snapshot folder and ends."""
    env = {**os.environ, "NBDDP_SHM_DIR": str(tmp_path)}
    kernel = subprocess.Popen([sys.executable, "-c", KEEPING_KERNEL], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert kernel.stdout is not None
        folder, keeper = kernel.stdout.readline().split()
        assert Path(folder).is_dir() and int(keeper) in descendants(kernel.pid)
        keeping = _snapshot([int(keeper)])
    finally:
        kernel.kill()
        kernel.wait()
    wait_until(lambda: not Path(folder).exists(), timeout=10)
    wait_until(lambda: not _alive(keeping), timeout=10)


@pytest.mark.fast
def test_a_child_forked_from_the_kernel_does_not_hold_the_snapshots_open(tmp_path,
                                                                         monkeypatch):
    """A notebook's forked worker that outlived a killed kernel would keep the keeper's
    pipe open, and the snapshots in memory: the child closes its copy."""
    monkeypatch.setenv("NBDDP_SHM_DIR", str(tmp_path))
    snapshots = SessionSnapshots(nprocs=2)
    snapshots.turn_on()
    try:
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # (the child: says whether its copy of the pipe is closed)
            os.write(write, b"closed" if snapshots._keeper.stdin.closed else b"open")
            os._exit(0)
        os.close(write)
        os.waitpid(child, 0)
        assert os.read(read, 16) == b"closed" and not snapshots._keeper.stdin.closed
        os.close(read)
    finally:
        snapshots.turn_off()


# --- a session through a real kernel -------------------------------------------------

START = """
%load_ext nbddp
import os, nbddp
%ddp_session start --nprocs 2 --snapshots
"""

BUILD = """
import threading
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
net = DDP(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
shard = torch.full((3,), float(dist.get_rank()))
big = torch.zeros(64 * 2**20)  # 256 MiB
big[dist.get_rank()] = 7.0
lock = threading.Lock()
"""

STEP = """
torch.manual_seed(10 + dist.get_rank() + int(shard.sum()))
loss = net(torch.randn(8, 4)).sum()
opt.zero_grad()
loss.backward()
opt.step()
_next = torch.rand(3, generator=torch.Generator().set_state(torch.get_rng_state()))
"""

EVERY_RANK = """
_every = [None] * dist.get_world_size()
dist.all_gather_object(_every, _mine)
_every
"""

STATE = """
_momentum = opt.state[net.module.weight]["momentum_buffer"]
_mine = (dist.get_rank(), net.module.weight.flatten().tolist(), _momentum.flatten().tolist(),
         shard.tolist(), float(big.sum()), _next.tolist())
""" + EVERY_RANK

NEXT_DRAW = "_mine = torch.rand(3).tolist()" + EVERY_RANK
"""Each rank's next draw from its RNG, before anything else draws."""


def _state(kernel: Kernel) -> list:
    """Each rank's: its rank, weights, momentum, shard, big tensor's sum, next draw."""
    return ast.literal_eval(cell(kernel, STATE).assert_ok().result())


@pytest.fixture
def snapshotting(tmp_path):
    kernel = Kernel(tmp_path)
    try:
        kernel.run(START, timeout=120).assert_ok()
        said = cell(kernel, BUILD, timeout=120).assert_ok().stream_text("stderr")
        said += cell(kernel, STEP).assert_ok().stream_text("stderr")  # (or after it)
        assert said.count("cannot keep lock (TypeError: cannot pickle '_thread.lock' "
                          "object)") == 1, said
        yield kernel
    finally:
        kernel.shutdown()


def _kill(kernel: Kernel, ranks) -> None:
    pids = session_pids(kernel)
    for rank in ranks:
        os.kill(pids[rank], signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.waits
@pytest.mark.parametrize("victims", [[1], [0, 1]])
def test_ranks_killed_between_cells_come_back_with_their_own_state(snapshotting, victims):
    kernel = snapshotting
    before = _state(kernel)  # (a cell that binds nothing: the state is the step's)
    _kill(kernel, victims)
    run = cell(kernel, NEXT_DRAW).assert_ok()
    said = run.stream_text()
    assert "while idle; the session restarted on new ranks, which restore " in said, said
    assert "not restored: lock (TypeError" in said, said
    assert said.count("restarted on new ranks") == 1, said
    draws = ast.literal_eval(run.result())
    assert draws == [state[5] for state in before]  # each rank's RNG went on from its own
    after = _state(kernel)
    assert [s[:5] for s in after] == [s[:5] for s in before]
    assert before[0][3] != before[1][3] and before[0][4] == before[1][4] == 7.0
    cell(kernel, STEP).assert_ok()  # DDP trains on, on the new process group
    stepped = _state(kernel)
    assert stepped[0][1] == stepped[1][1] != before[0][1]
    assert "lock" not in ast.literal_eval(cell(kernel, "sorted(dir())").assert_ok().result())


@pytest.mark.slow
@pytest.mark.waits
def test_a_rank_killed_mid_cell_costs_that_cell_only(snapshotting):
    kernel = snapshotting
    before = _state(kernel)
    pids = session_pids(kernel)
    run = kernel.submit("%%ddp\nimport time\nlost = 1\nprint('working', flush=True)\n"
                        "time.sleep(60)")
    run.wait_for_output("working")
    os.kill(pids[1], signal.SIGKILL)
    run.finish(timeout=90)
    text = run.error_text()
    assert "the session restarted on new ranks, which restore " in text, run.describe()
    assert "the cell that was running is lost; not restored: lock" in text, text
    assert [s[:5] for s in _state(kernel)] == [s[:5] for s in before]
    assert "lost" not in ast.literal_eval(cell(kernel, "sorted(dir())").assert_ok().result())
    cell(kernel, STEP).assert_ok()


@pytest.mark.slow
@pytest.mark.waits
def test_snapshots_turned_off_free_everything_and_a_loss_is_as_before(snapshotting):
    kernel = snapshotting
    assert list(Path(SHM).glob("nbddp-snapshots-*"))
    status = kernel.run("%ddp_session snapshots off").assert_ok().result()
    assert "snapshots off" in status, status
    assert not list(Path(SHM).glob("nbddp-snapshots-*"))
    _kill(kernel, [1])
    run = cell(kernel, "'net' in dir()").assert_ok()
    assert run.result() == "False"
    assert "variables defined in earlier cells are gone" in run.stream_text(), run.describe()


@pytest.mark.slow
@pytest.mark.waits
def test_a_cap_too_small_pauses_snapshots_once_and_the_last_kept_is_restored(snapshotting):
    """The 256 MiB tensor does not fit a 64 MiB cap: the next cells take no snapshot,
    said once; ranks lost then come back from the last cell kept (the step, cell 2)."""
    kernel = snapshotting
    status = kernel.run("%ddp_session snapshots on --snapshot-max 64MiB").assert_ok()
    # (cell 2 has just ended: its snapshot may still be being written, which is waited for)
    assert "snapshots on (at most 64 MiB): cell 2, " in status.result(), status.describe()
    said = "".join(cell(kernel, STEP).assert_ok().stream_text("stderr") for _ in range(3))
    assert said.count("nbddp: session snapshots paused: one of cell 3 would take ") == 1, said
    assert said.count("paused") == 1 and "the newest kept: cell 2" in said, said
    _kill(kernel, [1])
    said = cell(kernel, "1").assert_ok().stream_text()
    assert re.search(r"which restore \d+ names from cell 2 \(", said), said
    refused = kernel.run("%ddp_session snapshots on --snapshot-max lots").stream_text("stderr")
    assert "UsageError" in refused and "512MiB" in refused, refused
