"""Large tensors sent again cost nothing: their bytes stay in shared memory between sends.

Unit tests of the kept copies first (packed and mapped in this process, as a rank maps
them), then the same rules through a real Jupyter kernel: by value both ways, for a
one-off launch and for a session, copies released when the notebook lets its tensor
go, and nothing left of them once the kernel is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import weakref

import pytest
import torch

import nbddp
from nbddp._wire import dataplane, kept_storages
from nbddp._wire.kept_storages import KEEP_ENV, KEEP_MIN, KeptCopy, KeptStorages

from .conftest import wait_until

FLOATS = KEEP_MIN // 4  # a float32 tensor just large enough to be kept
NOBODY = 65534


def memory_files(pid: int) -> set[int]:
    """The inodes of the kept copies process ``pid`` holds open or mapped."""
    found = set()
    for where in ("fd", "map_files"):
        folder = f"/proc/{pid}/{where}"
        for name in os.listdir(folder):
            try:
                link = os.readlink(f"{folder}/{name}")
                if link.startswith("/memfd:nbddp-tensor"):
                    found.add(os.stat(f"{folder}/{name}").st_ino)
            except OSError:
                continue
    return found


def copies(packed: dataplane.Packed) -> list[KeptCopy]:
    """The kept copies a payload names."""
    return [owner for owner in packed.owners if isinstance(owner, KeptCopy)]


def sent(value, kept: KeptStorages):
    """``value`` as a rank gets it (packed with ``kept``, loaded here)."""
    return dataplane.pack(value, kept=kept).load()


@pytest.mark.fast
def test_an_unchanged_tensor_is_copied_once_and_a_changed_one_again():
    kept = KeptStorages()
    data = torch.ones(FLOATS)
    first = dataplane.pack(data, kept=kept)
    assert first.buffers == [] and len(kept) == 1  # no bytes in the payload itself
    again = dataplane.pack(data, kept=kept)
    assert copies(again) == copies(first)  # the same copy: nothing copied

    data[0] = 5  # written in place: torch's version counter moves
    changed = dataplane.pack(data, kept=kept)
    assert copies(changed) != copies(first)
    assert float(changed.load()[0]) == 5 and float(first.load()[0]) == 1


@pytest.mark.fast
def test_a_write_that_bypasses_the_version_counter_is_caught_by_the_sample():
    kept = KeptStorages()
    data = torch.ones(FLOATS)
    first = dataplane.pack(data, kept=kept)
    data.data.mul_(3)  # .data has a counter of its own: data's does not move
    assert float(dataplane.pack(data, kept=kept).load()[-1]) == 3
    assert float(first.load()[-1]) == 1


@pytest.mark.fast
def test_what_a_rank_maps_is_its_own_and_the_notebook_keeps_its_values():
    kept = KeptStorages()
    data = torch.ones(FLOATS)
    on_rank = sent(data, kept)
    on_rank.mul_(0)  # a rank's write: its private pages
    assert float(data.sum()) == FLOATS
    assert float(sent(data, kept).sum()) == FLOATS  # the next send: the notebook's values


@pytest.mark.fast
def test_views_share_one_copy_and_come_back_as_views():
    kept = KeptStorages()
    data = torch.arange(FLOATS, dtype=torch.float32)
    whole, columns = sent((data, data.view(-1, 64)[:, ::2]), kept)
    assert len(kept) == 1
    assert torch.equal(columns, data.view(-1, 64)[:, ::2])
    whole[2] = -1.0
    assert float(columns[0, 1]) == -1.0


@pytest.mark.fast
def test_a_models_parameters_are_sent_again_free_until_an_optimizer_step():
    kept = KeptStorages()
    model = torch.nn.Linear(1024, 1024)
    first = dataplane.pack(model, kept=kept)
    assert len(copies(first)) == 1  # the weight (the bias is too small to keep)
    assert copies(dataplane.pack(model, kept=kept)) == copies(first)
    back = first.load()
    assert isinstance(back.weight, torch.nn.Parameter) and back.weight.requires_grad
    assert torch.equal(back.weight, model.weight)

    model(torch.ones(1024)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    stepped = dataplane.pack(model, kept=kept)
    assert copies(stepped) != copies(first)
    assert torch.equal(stepped.load().weight, model.weight)


@pytest.mark.fast
def test_a_parameter_sent_after_every_step_gathers_nothing_on_it():
    kept = KeptStorages()
    model = torch.nn.Linear(1024, 1024)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(20):
        model(torch.ones(1024)).sum().backward()
        optimizer.step()
        dataplane.pack(model, kept=kept)
    assert len(kept) == 1
    assert weakref.getweakrefcount(model.weight) <= 2  # not one watcher per send


@pytest.mark.fast
def test_a_tensor_object_the_copy_was_not_made_for_is_not_taken_on_trust():
    kept = KeptStorages()
    data = torch.ones(FLOATS)
    made = copies(dataplane.pack(data, kept=kept))
    alias = data.data  # the same storage, a version counter of its own
    alias[7] = 5.0  # (data's counter does not move; a sample would likely miss it)
    again = copies(dataplane.pack(alias, kept=kept))
    assert again != made and float(dataplane.pack(alias, kept=kept).load()[7]) == 5.0


@pytest.mark.fast
def test_a_parameter_subclass_is_copied_at_every_send_never_sent_stale():
    class Tagged(torch.nn.Parameter):
        pass

    kept = KeptStorages()
    weight = Tagged(torch.ones(FLOATS))
    first = dataplane.pack(weight, kept=kept)
    weight.data[3] = 2.0  # through torch's own pickling, each send has a fresh .data
    second = dataplane.pack(weight, kept=kept)
    assert copies(second) != copies(first) and float(second.load()[3].detach()) == 2.0


@pytest.mark.fast
def test_copies_stay_within_their_share_of_memory(monkeypatch):
    monkeypatch.setattr(kept_storages, "_memory_limit", lambda: 3 * KEEP_MIN)
    monkeypatch.setattr(kept_storages, "KEEP_SHARE", 0.5)  # room for one copy
    kept = KeptStorages()
    first, second = torch.ones(FLOATS), torch.zeros(FLOATS)
    dataplane.pack(first, kept=kept)
    dataplane.pack(second, kept=kept)
    assert len(kept) == 1  # the copy least recently sent made room
    assert copies(dataplane.pack(second, kept=kept))  # the newest stays
    too_large = dataplane.pack(torch.ones(2 * FLOATS), kept=kept)
    assert copies(too_large) == [] and len(too_large.buffers) == 1


@pytest.mark.fast
def test_copies_are_read_only_files_and_a_forked_child_holds_none():
    kept = KeptStorages()
    data = torch.ones(FLOATS)
    copy = copies(dataplane.pack(data, kept=kept))[0]
    assert os.stat(f"/proc/self/fd/{copy.fd}").st_mode & 0o777 == 0o400
    child = os.fork()
    if child == 0:  # a notebook's forked worker
        os._exit(0 if not memory_files(os.getpid()) else 1)
    assert os.waitpid(child, 0)[1] == 0, "the forked child still held the kernel's copies"


@pytest.mark.fast
def test_what_has_no_version_counter_or_is_small_travels_in_the_payload():
    np = pytest.importorskip("numpy")
    kept = KeptStorages()
    with torch.inference_mode():
        inferred = torch.ones(FLOATS)  # (torch keeps no version counter for it)
    packed = dataplane.pack((torch.ones(FLOATS // 2), np.ones(FLOATS, np.float32), inferred),
                            kept=kept)
    assert len(kept) == 0 and len(packed.buffers) == 3
    assert float(packed.load()[2].sum()) == FLOATS


@pytest.mark.fast
def test_a_copy_is_released_once_its_tensor_is_gone_or_changed():
    kept = KeptStorages()
    before = memory_files(os.getpid())  # (earlier tests' mappings, not yet collected)
    data, other = torch.ones(FLOATS), torch.zeros(FLOATS)
    dataplane.pack((data, other), kept=kept)
    assert len(memory_files(os.getpid()) - before) == 2
    del data
    wait_until(lambda: len(memory_files(os.getpid()) - before) == 1, timeout=5)
    other.add_(1)  # changed, not sent again: released at the next send of anything
    dataplane.pack(None, kept=kept)
    assert memory_files(os.getpid()) - before == set() and len(kept) == 0


@pytest.mark.fast
def test_a_changed_tensors_next_copy_reuses_the_last_ones_file_where_nothing_maps_it():
    kept = KeptStorages()
    data = torch.ones(FLOATS)
    first = copies(dataplane.pack(data, kept=kept))[0].inode  # (the payload is dropped)
    data.add_(1)
    second = dataplane.pack(data, kept=kept)
    assert copies(second)[0].inode == first  # its pages were there: the write alone
    assert float(second.load()[0]) == 2

    on_rank = second.load()  # as a session rank that kept a name maps it
    del second
    data.add_(1)
    third = dataplane.pack(data, kept=kept)
    assert copies(third)[0].inode != first  # a new file: the mapped one stays as it was
    assert (float(on_rank[0]), float(third.load()[0])) == (2, 3)
    assert kept.files.spares() == []  # what this send did not take is not kept


@pytest.mark.fast
def test_a_payload_keeps_its_copies_open_until_it_is_dropped():
    kept = KeptStorages()
    before = memory_files(os.getpid())
    packed = dataplane.pack(torch.ones(FLOATS), kept=kept)  # the tensor is gone at once
    time.sleep(0.2)
    assert len(kept) == 0 and len(memory_files(os.getpid()) - before) == 1
    assert float(packed.load().sum()) == FLOATS  # what a rank maps is still there
    del packed
    assert memory_files(os.getpid()) - before == set()


@pytest.mark.fast
@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user takes root")
def test_another_user_can_neither_open_a_kept_copy_nor_read_it():
    """The way a rank opens a copy (``/proc/<kernel>/fd/<n>``) is closed to other users:
    the system lets only a process that could debug the kernel through."""
    kept = KeptStorages()
    data = torch.ones(FLOATS)
    copy = copies(dataplane.pack(data, kept=kept))[0]
    attempt = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-c",
         'head -c 16 "$0" | od -An -tx1; ls "$1"', f"/proc/{os.getpid()}/fd/{copy.fd}",
         f"/proc/{os.getpid()}/fd"], capture_output=True, text=True, timeout=30)
    assert attempt.stdout.strip() == "", attempt.stdout  # not one byte
    assert attempt.stderr.count("Permission denied") == 2, attempt.stderr


@pytest.mark.fast
def test_a_rank_told_of_a_copy_that_is_gone_says_so():
    kept = KeptStorages()
    data = torch.ones(FLOATS)
    packed = dataplane.pack(data, kept=kept)
    copy = copies(packed)[0]
    os.dup2(os.open("/dev/null", os.O_RDONLY), copy.fd)  # that number now names another file
    with pytest.raises(RuntimeError, match="shared copy of a tensor is gone"):
        packed.load()


def test_kept_copies_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(KEEP_ENV, "0")
    before = memory_files(os.getpid())
    data = torch.ones(FLOATS)
    total = nbddp.launch(lambda: float(data.sum()), nprocs=2, output="none")
    assert total == FLOATS and memory_files(os.getpid()) - before == set()  # none made


# --- through a real kernel ----------------------------------------------------------

SETUP = f"import torch, nbddp\ndata = torch.ones({FLOATS})\n"


def test_launches_send_a_tensor_by_value_both_ways_and_again_for_free(kernel):
    kernel.run(SETUP).assert_ok()
    kernel.run("""
        def zeroes_its_own():
            seen = float(data.sum())
            data.mul_(0)  # the rank's copy only
            return seen
        first = nbddp.launch(zeroes_its_own, nprocs=2, output="none")
    """).assert_ok()
    copy = memory_files(kernel.pid)
    assert len(copy) == 1
    kernel.run('again = nbddp.launch(zeroes_its_own, nprocs=2, output="none")').assert_ok()
    assert memory_files(kernel.pid) == copy  # sent from the same copy: nothing copied
    run = kernel.run("""
        data += 1  # the notebook's write: the next launch sees it
        changed = nbddp.launch(zeroes_its_own, nprocs=2, output="none")
        first, again, changed, float(data.sum())
    """).assert_ok()
    assert run.result() == f"({FLOATS}.0, {FLOATS}.0, {2 * FLOATS}.0, {2 * FLOATS}.0)"
    assert len(memory_files(kernel.pid)) == 1  # the new copy (maybe in the last one's file)
    kernel.run("del data").assert_ok()


def test_a_session_sees_the_notebooks_changes_and_keeps_its_own_names(kernel):
    kernel.run(SETUP + "session = nbddp.Session(2, output='none')").assert_ok()
    try:
        kernel.run("""
            def keep():
                global kept
                kept = data  # the ranks' name: the tensor as this cell sent it
            session.run(keep)
            data += 1  # (a statement: Out[] keeps no reference to the tensor)
        """).assert_ok()
        run = kernel.run("""
            session.run(lambda: (float(data[0]), float(kept[0])))
        """).assert_ok()
        assert run.result() == "(2.0, 1.0)"

        kernel.run("del data").assert_ok()
        kernel.run("session.run(lambda: None)").assert_ok()
        assert memory_files(kernel.pid) == set()  # released, and not held for the ranks
    finally:
        kernel.run("session.close()").assert_ok()


def test_a_killed_kernel_leaves_no_copy_behind(fresh_kernel):
    fresh_kernel.run(SETUP + "session = nbddp.Session(2, output='none')\n"
                     "session.run(lambda: float(data.sum()))").assert_ok()
    copies = memory_files(fresh_kernel.pid)
    assert len(copies) == 1
    os.kill(fresh_kernel.pid, signal.SIGKILL)
    # The copy has no name: it lasts only while a process holds it open or mapped.
    wait_until(lambda: not holders(copies), timeout=15)


def holders(inodes: set[int]) -> list[int]:
    """This user's processes that hold one of ``inodes`` (memory files) open or mapped."""
    found = []
    for pid in (int(name) for name in os.listdir("/proc") if name.isdigit()):
        try:
            if os.stat(f"/proc/{pid}").st_uid == os.getuid() and memory_files(pid) & inodes:
                found.append(pid)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found
