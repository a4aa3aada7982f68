"""Tensors and arrays cross between notebook and ranks out of band, mapped, copy-on-write.

Unit tests of the data files first (pack, write, map), then real launches: exact round
trips, the copy-on-write rule, results that outlive their run, a fallback without
shared memory, no leftovers in ``/dev/shm`` after failures, and a 5 GiB result. The
autouse leftover check also fails any test that leaves a ``/dev/shm/nbddp-*`` behind.
"""

from __future__ import annotations

import contextlib
import glob
import linecache
import os
import signal
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import nbddp
from nbddp._wire import dataplane as dataplane
from nbddp._wire.frames import HEADER_SIZE, body_size, encode
from nbddp._wire.messages import Hello
from nbddp._wire.payload import Payload

from .conftest import SHM, wait_until

MIB = 2**20


def values() -> dict:
    """Something of everything that crosses the boundary."""
    torch.manual_seed(0)
    base = torch.randn(512, 512)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.ReLU(),
                                torch.nn.Linear(300, 10))
    return {
        "dtypes": [torch.arange(100_000).to(dtype) for dtype in
                   (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                    torch.int8, torch.uint8, torch.int64, torch.bool, torch.complex64)],
        "base": base,
        "columns": base[:, ::3],  # a non-contiguous view of base
        "row": base[7],
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "leaf": torch.ones(100_000, requires_grad=True),
        "arrays": (np.arange(200_000, dtype=np.float32), np.ones((300, 400), order="F"),
                   np.arange(100_000)[::2]),
        "model": model,
        "state": model.state_dict(),
        "nested": {"deep": [(torch.full((70_000,), 2.0), {"k": np.zeros(80_000)})]},
    }


def same(a, b) -> bool:
    """Equal values of the same types, dtypes and shapes, all the way down."""
    if isinstance(a, torch.Tensor):
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
                and a.requires_grad == b.requires_grad and torch.equal(a.detach(), b.detach()))
    if isinstance(a, np.ndarray):
        return type(b) is np.ndarray and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.nn.Module):
        return type(a) is type(b) and same(a.state_dict(), b.state_dict())
    return a == b


def roundtrip(value, tmp_path: Path):
    path = tmp_path / "value.data"
    dataplane.write(path, dataplane.pack(value))
    try:
        return dataplane.read(path).load()
    finally:
        path.unlink()


# --- data files ---------------------------------------------------------------------


def test_values_come_back_exactly_with_views_still_views(tmp_path):
    sent = values()
    packed = dataplane.pack(sent)
    assert len(packed.data) < MIB  # the bytes are out of band
    back = roundtrip(sent, tmp_path)
    assert same(sent, back)
    assert back["columns"].untyped_storage().data_ptr() == back["base"].untyped_storage().data_ptr()
    back["base"][0, 0] = 123.0
    assert back["columns"][0, 0] == 123.0  # still a view of base
    assert sent["base"][0, 0] != 123.0


def test_a_mapped_value_is_private_writable_and_outlives_its_file(tmp_path):
    path = tmp_path / "shared.data"
    dataplane.write(path, dataplane.pack(torch.zeros(MIB)))
    first, second = dataplane.read(path).load(), dataplane.read(path).load()
    path.unlink()
    first += 1  # copy-on-write: the other mapping of the same file does not see it
    assert first.sum() == MIB and second.sum() == 0  # and both outlive the file


def test_data_files_are_private(tmp_path):
    path = tmp_path / "private.data"
    dataplane.write(path, dataplane.pack(torch.ones(MIB)))
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_code_sent_by_value_keeps_the_file_it_was_written_in():
    """A function (and the comprehension inside it) defined here comes back under this
    file's name, so a rank's traceback can show its lines; cloudpickle 3.1.3 renames
    every such file ``<dynamic-code>``."""

    def squares(n):
        return [i * i for i in range(n)]

    back = dataplane.pack(squares).load()
    assert back(4) == [0, 1, 4, 9]
    assert back.__code__.co_filename == __file__
    inner = [c for c in back.__code__.co_consts if hasattr(c, "co_filename")]
    assert all(code.co_filename == __file__ for code in inner)


def test_a_payload_carries_the_sources_of_the_cells_whose_code_it_ships(monkeypatch):
    """A rank's traceback shows the lines of notebook code it runs: the payload carries
    the source of each cell whose code it ships, and of no other, so its size does not
    grow with the notebook (before, every cell went with every run: 300 cells made a
    session's no-op run three times slower)."""
    monkeypatch.setattr(linecache, "cache", dict(linecache.cache))  # (this test's own)

    def cell(name: str, source: str) -> None:  # as IPython registers a cell it runs
        lines = source.splitlines(keepends=True)
        linecache.cache[name] = (len(source), None, lines, name)

    for i in range(300):
        cell(f"/tmp/ipykernel_0/cell-{i}.py", f"value_{i} = {i}  # an earlier cell\n" * 30)
    helper_cell = "/tmp/ipykernel_0/helper.py"
    cell(helper_cell, "def helper(x):\n    return x + 1\n")
    defined: dict = {}
    exec(compile(linecache.cache[helper_cell][2][0] + "    return x + 1\n", helper_cell,
                 "exec"), defined)
    helper = defined["helper"]

    def train():
        return helper(1)

    packed = Payload.capture(train, (), {}).dumps()
    assert len(packed.data) < 20_000, len(packed.data)
    back = Payload.unpack(packed)
    assert set(back.sources) == {helper_cell}  # (train's own file is on disk)
    assert back.fn() == 2


def test_frames_carry_any_length():
    header = encode(Hello(0, 1))[:HEADER_SIZE]
    assert HEADER_SIZE == 8 and body_size(header) == len(encode(Hello(0, 1))) - HEADER_SIZE
    assert body_size((5 * 2**30).to_bytes(8, "big")) == 5 * 2**30  # past 4 GiB


def test_shared_memory_without_room_falls_back(tmp_path):
    assert dataplane.place(MIB, tmp_path, Path(SHM)) == Path(SHM)
    assert dataplane.place(2**62, tmp_path, Path(SHM)) == tmp_path  # no room
    assert dataplane.place(MIB, tmp_path, None) == tmp_path  # none at all


def test_a_room_allocated_ahead_becomes_the_file(tmp_path):
    room = dataplane.Room(tmp_path / "room", 4 * MIB)
    path = room.take()
    assert path == tmp_path / "room" and os.stat(path).st_size == 4 * MIB
    assert os.stat(path).st_blocks * 512 >= 4 * MIB  # allocated, not a hole
    inode = os.stat(path).st_ino
    sent = {"small": torch.arange(10), "big": torch.randn(3 * MIB // 4)}
    dataplane.write(tmp_path / "value.data", dataplane.pack(sent), room=path)
    assert not path.exists() and os.stat(tmp_path / "value.data").st_ino == inode
    assert same(dataplane.read(tmp_path / "value.data").load(), sent)  # cut to its size
    dataplane.write(tmp_path / "again.data", dataplane.pack(sent), room=path)  # taken: fresh
    assert same(dataplane.read(tmp_path / "again.data").load(), sent)


def test_a_room_where_it_does_not_fit_is_not_made(tmp_path):
    room = dataplane.Room(Path(SHM) / f"nbddp-test-room-{os.getpid()}", 2**62)
    assert room.take() is None
    room.discard()


# --- through launches ---------------------------------------------------------------


def echo(value):
    return value


def test_everything_round_trips_through_the_ranks():
    sent = values()
    back = nbddp.launch(echo, 2, args=(sent,), all_ranks=True)
    assert all(same(sent, b) for b in back)


def test_captured_data_is_copy_on_write_for_each_rank():
    data = torch.zeros(4 * MIB)

    def write_mine():
        import torch.distributed as dist

        rank = dist.get_rank()
        data[rank] = rank + 1  # in place, on this rank's mapping
        dist.barrier()  # both ranks have written
        return data[:2].tolist()

    assert nbddp.launch(write_mine, 2, all_ranks=True) == [[1.0, 0.0], [0.0, 2.0]]
    assert data[:2].tolist() == [0.0, 0.0]  # the notebook's tensor is untouched


def test_results_are_ordinary_writable_tensors_that_outlive_the_run():
    def make():
        return torch.arange(8 * MIB, dtype=torch.float32), np.ones(MIB)

    job = nbddp.launch(make, 2, wait=False)
    tensor, array = job.result()
    job.cancel()  # waits until the run's processes and files are gone
    assert job.done() and not glob.glob(os.path.join(SHM, "nbddp-*"))
    tensor += 1
    array[0] = 5
    assert tensor[-1].item() == 8 * MIB and array.sum() == MIB + 4


def test_without_shared_memory_data_goes_through_the_run_dir(monkeypatch):
    monkeypatch.setenv("NBDDP_SHM_DIR", "")
    before = set(os.listdir(SHM))
    sent = torch.arange(2 * MIB, dtype=torch.float64)

    def total(t):
        return t.sum(), t * 2

    s, doubled = nbddp.launch(total, 2, args=(sent,))
    assert torch.equal(doubled, sent * 2) and s == sent.sum()
    assert set(os.listdir(SHM)) == before


def mapped_inode(tensor) -> int:
    """The inode of the file this process maps ``tensor``'s memory from (0: none)."""
    address = tensor.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, _, _, _, inode, *_ = line.split()
        low, high = (int(end, 16) for end in span.split("-"))
        if low <= address < high:
            return int(inode)
    return 0


def inode_and_doubled(data):
    tensor = torch.from_numpy(data)
    return mapped_inode(tensor), tensor * 2


def test_standby_ranks_get_and_give_data_through_memory_allocated_ahead(standby_on):
    # 32 MiB each way, an array: a tensor's bytes would be kept from the first send
    # (``test_kept_storages``), but an array has no version counter and is sent each time.
    data = np.random.default_rng(0).standard_normal(8 * MIB, dtype=np.float32)
    nbddp.launch(inode_and_doubled, 2, args=(data,))

    def rooms() -> dict[str, int] | None:  # the next group's, once both are allocated
        wanted = [Path(SHM).glob(f"nbddp-*/room-{name}") for name in ("payload", "result")]
        with contextlib.suppress(FileNotFoundError):  # (a room written as ``.part`` first)
            found = {path.name: path.stat().st_ino for paths in wanted for path in paths}
            return found if set(found) == {"room-payload", "room-result"} else None
        return None

    ahead = wait_until(rooms, timeout=120)
    wait_until(lambda: nbddp.standby().status == "ready", timeout=120)
    job = nbddp.launch(inode_and_doubled, 2, args=(data,), wait=False)
    inode, doubled = job.result()
    assert job.warm
    assert inode == ahead["room-payload"]  # the ranks mapped the room the payload went to
    assert mapped_inode(doubled) == ahead["room-result"]  # and rank 0 wrote into its room
    assert torch.equal(doubled, torch.from_numpy(data) * 2)


def test_large_tensors_no_longer_warn_but_large_python_objects_do():
    big = torch.zeros(200 * MIB // 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nbddp.launch(len, 2, args=(big,), init=False) == len(big)


def fails_after_rank_0_wrote(data):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(1)  # rank 0's result file exists by now
        raise ValueError("rank 1 fails")
    return data * 2


@pytest.mark.parametrize("how", ["failure", "timeout", "interrupt"])
def test_no_data_file_outlives_a_run_that_fails(how, tmp_path):
    data = torch.ones(16 * MIB)  # payload and rank 0's result are data files
    if how == "failure":
        with pytest.raises(nbddp.WorkerError, match="rank 1 fails"):
            nbddp.launch(fails_after_rank_0_wrote, 2, args=(data,))
    elif how == "timeout":
        with pytest.raises(TimeoutError):
            nbddp.launch(sleep_holding, 2, args=(data,), timeout=3)
    else:
        started = tmp_path / "started"
        threading.Thread(target=_interrupt_when, args=(started,), daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            nbddp.launch(sleep_holding, 2, args=(data, str(started)))
    assert not glob.glob(os.path.join(SHM, "nbddp-*"))


def sleep_holding(data, started=None):
    if started:
        open(started, "w").close()
    time.sleep(60)


def _interrupt_when(started: Path) -> None:
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGINT)


def _available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


@pytest.mark.slow
@pytest.mark.skipif(_available_gib() < 16, reason="a 5 GiB result needs about 11 GiB free")
def test_a_5_gib_result():
    def make():
        return torch.ones(5 * 2**30, dtype=torch.uint8)

    result = nbddp.launch(make, 1, init=False)
    assert result.numel() == 5 * 2**30 and result[-1].item() == 1
    assert result[::2**20].sum().item() == 5 * 2**10
