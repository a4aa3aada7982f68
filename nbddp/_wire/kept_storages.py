"""Large tensors' bytes kept in shared memory from one send to the next: sent again, an
unchanged tensor costs nothing.

The first time the kernel sends a large CPU tensor to ranks on this machine, its
storage's bytes are copied into a memory file of their own (``memfd``), and the payload
names that file instead of carrying the bytes. The next send of the same storage, if it
has not changed, names the same file again: nothing is copied. A rank maps the file
copy-on-write, as it maps a payload file.

By value, both ways. The kernel never writes to a file once it is made: a tensor
changed in the notebook gets a new file at its next send, and a rank that kept a name
from an earlier cell keeps the old bytes (its mapping outlives the file's release). A
rank's writes go to its private pages; the notebook's tensor is never touched.

Whether a storage changed since its copy is told by the version counters of the tensor
objects it was made for (torch bumps one at every in-place write through the tensor or
its views; a ``Parameter`` is sent with its own counter, which the optimizer's steps
bump): another object over the same storage has a counter of its own, and is not taken
on trust. Writes
that bypass the counter (through ``.data``, ``.numpy()``, or the NumPy array a tensor
was made from) are caught where they changed much of the tensor: each send compares
``SAMPLES`` random places of the tensor with its copy. NumPy arrays have no counter at
all: they are copied at every send, and so are tensors made under
``torch.inference_mode`` (torch keeps no counter for them).

Memory stays bounded: a copy is released once its storage is freed in the notebook (the
tensor deleted), or found changed (at the next send, or once the tensor that was sent
is seen changed); at most ``MAX_KEPT`` are kept, in ``KEEP_SHARE`` of the memory (the
least recently sent go first), and a forked child of the kernel closes its inherited
descriptors of them. A changed tensor's next copy is
written into its last copy's file where no process maps that any more
(``memory_files``): its pages are there already. A memory file has no name: only a
process of the same user can open it (through ``/proc/<kernel>/fd``, checked like a
debugger's access), and it is gone once the kernel and every rank that mapped it are,
however they ended: a killed kernel leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .dataplane import write_at
from .memory_files import MemoryFiles
from .tensor_pickler import storage_from_buffer

KEEP_MIN = 4 * 2**20
"""Smaller storages travel in the payload file: copying them costs less than a file."""
MAX_KEPT = 256
"""Copies kept at most (each holds a file descriptor of the kernel's)."""
KEEP_SHARE = 0.5
"""The share of the machine's (or the kernel's cgroup's) memory copies may take."""
SAMPLES = 64
"""Random places of a tensor compared with its copy at each send, ``SAMPLE_BYTES`` each
(a tenth of a millisecond in all)."""
SAMPLE_BYTES = 64
SWEEP_AFTER = 0.05
"""Seconds from a sent tensor's end to the sweep that releases its copy."""


class KeptCopy:
    """One storage's bytes in a memory file, and what they were copied from. Pickled as
    the file's address, which a rank maps (``_map_copy``). The file is released (closed,
    or kept for a next copy where no process maps it: ``memory_files``) when neither the
    kept copies nor a payload on its way hold this any more."""

    def __init__(self, tensor: Any, storage: Any, files: MemoryFiles,
                 on_gone: Callable[[Any], None]) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self.nbytes = storage.nbytes()
        self.data_ptr = storage.data_ptr()
        self.storage = StorageWeakRef(storage)  # (the storage's memory is not kept alive)
        self.fd = files.new(self.nbytes)
        self._reuse = [False]
        self._release = weakref.finalize(self, files.release, self.fd, self.nbytes,
                                         self._reuse)
        self._release.atexit = False  # (at the exit, the process's end closes every file)
        _ALL_COPIES.add(self)
        self._on_gone = on_gone
        self._seen = [(weakref.ref(tensor, on_gone), tensor._version)]
        """Each tensor object this copy was made for, and its version counter then (its
        end calls ``on_gone``, while this copy lives)."""
        _write(storage, self.fd)
        self.inode = os.fstat(self.fd).st_ino

    def __reduce__(self) -> tuple[Any, ...]:
        return _map_copy, (os.getpid(), self.fd, self.inode, self.nbytes)

    def holds(self, tensor: Any, storage: Any) -> bool:
        """The copy still holds ``tensor``'s storage as it is now: ``tensor`` is one it
        was made for (another object's counter tells nothing of this one's writes), no
        tensor it was made for has been written since, and a sample still matches."""
        return (not self.storage.expired() and storage.data_ptr() == self.data_ptr
                and storage.nbytes() == self.nbytes
                and any(ref() is tensor for ref, _ in self._seen)
                and not self.changed() and self._same_sample(storage))

    def also(self, tensor: Any) -> None:
        """Another tensor on the storage, pickled in the send that made this copy."""
        if not any(ref() is tensor for ref, _ in self._seen):
            self._seen.append((weakref.ref(tensor, self._on_gone), tensor._version))

    def replaced(self) -> None:
        """Its tensor changed: once released, its file may take the next copy."""
        self._reuse[0] = True

    def changed(self) -> bool:
        """A tensor it was made for (one still there) has been written since."""
        return any(tensor is not None and tensor._version != version
                   for tensor, version in ((ref(), version) for ref, version in self._seen))

    def forget(self) -> None:
        """(In a child forked from the kernel) Close this process's copy of the file."""
        self._release.detach()
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def _same_sample(self, storage: Any) -> bool:
        """``SAMPLES`` random places of the storage hold what the copy holds (read from
        the file: no mapping, no page faults)."""
        address = storage.data_ptr()
        for _ in range(SAMPLES):
            offset = _SAMPLER.randrange(max(1, self.nbytes - SAMPLE_BYTES + 1))
            length = min(SAMPLE_BYTES, self.nbytes - offset)
            if os.pread(self.fd, length, offset) != ctypes.string_at(address + offset, length):
                return False
        return True


_SAMPLER = random.Random()
"""nbddp's own random numbers: the notebook's (``random.seed``) stay its own."""


def _write(storage: Any, fd: int) -> None:
    """``storage``'s bytes into the file ``fd`` (OSError if memory is short)."""
    raw = (ctypes.c_ubyte * storage.nbytes()).from_address(storage.data_ptr())
    write_at(fd, memoryview(raw).cast("B"), 0)


_ALL_COPIES: weakref.WeakSet[KeptCopy] = weakref.WeakSet()
"""Every copy this process holds (a forked child closes theirs)."""


def _map_copy(pid: int, fd: int, inode: int, nbytes: int) -> Any:
    """(On a rank) The storage of a kept copy: the kernel's memory file mapped
    copy-on-write. An error that says so if the file is gone (or a descriptor of that
    number now names another file)."""
    try:
        opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
    except PermissionError as exc:
        raise RuntimeError(f"nbddp: this rank may not open the kernel's shared copy of a "
                           f"tensor ({exc}); set {KEEP_ENV}=0 in the notebook's environment "
                           "to send tensors' bytes with every run instead") from None
    except OSError as exc:
        raise RuntimeError(f"nbddp: the kernel's shared copy of a tensor is gone ({exc})") \
            from None
    try:
        status = os.fstat(opened)
        if status.st_ino != inode or status.st_size != nbytes:
            raise RuntimeError("nbddp: the kernel's shared copy of a tensor is gone")
        mapped = mmap.mmap(opened, nbytes, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(opened)
    return storage_from_buffer(mapped)


class KeptStorages:
    """The kernel's kept copies, by storage. ``copy_of`` gives the copy to send for a
    tensor (a new one if its storage changed); copies of storages freed or changed are
    released as soon as the tensor sent is seen to go (a thread of its own, woken then),
    and at every send."""

    def __init__(self) -> None:
        self._copies: dict[int, KeptCopy] = {}
        self.files = MemoryFiles()
        """Where copies are written: released ones' files are reused."""
        self._lock = threading.RLock()  # (a copy released by the collector re-enters)
        self._wake = threading.Event()
        self._sweeper: threading.Thread | None = None
        self._made_now: set[int] = set()  # the copies made in this send

    def __len__(self) -> int:
        return len(self._copies)

    def copy_of(self, tensor: Any, storage: Any) -> KeptCopy | None:
        """The kept copy of ``tensor``'s storage, made now if there is none or it is
        outdated; None where the storage is too small to keep, too large for the budget
        (``KEEP_SHARE`` of memory: the copies least recently sent go first), or memory
        is short (the bytes then travel in the payload)."""
        nbytes = storage.nbytes()
        if nbytes < KEEP_MIN or tensor.is_inference():  # (no version counter to watch)
            return None
        key = storage._cdata  # (unique while a copy's weak reference holds it)
        with self._lock:
            copy = self._copies.pop(key, None)
            if copy is not None and copy.holds(tensor, storage):
                self._copies[key] = copy  # (now the most recently sent)
                return copy
            if copy is not None:
                copy.replaced()
                copy = None  # (released: its file may take the new copy)
            if not self._room_for(nbytes):
                return None
        try:
            copy = KeptCopy(tensor, storage, self.files, self._tensor_gone)
        except OSError:
            return None
        with self._lock:
            self._copies[key] = copy
            self._made_now.add(id(copy))
        self._start_sweeper()
        return copy

    def seen_with(self, copy: Any, tensor: Any) -> None:
        """``tensor`` shares a storage this send already pickled as ``copy``: a copy made
        in this send holds it as it is now."""
        with self._lock:
            if isinstance(copy, KeptCopy) and id(copy) in self._made_now:
                copy.also(tensor)

    def _room_for(self, nbytes: int) -> bool:
        """(Under the lock) Make room for ``nbytes`` more within the budget, releasing
        the copies least recently sent; False if it cannot be made."""
        budget = _memory_limit() * KEEP_SHARE
        if nbytes > budget:
            return False
        kept = sum(copy.nbytes for copy in self._copies.values())
        while self._copies and (kept + nbytes > budget or len(self._copies) >= MAX_KEPT):
            kept -= self._copies.pop(next(iter(self._copies))).nbytes
        return True

    def _tensor_gone(self, _: Any) -> None:
        """A tensor a copy was made for is gone: its storage may be too (wake the sweeper)."""
        self._wake.set()

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """Around one send: outdated copies released first, the files of changed ones
        kept for their next copies in this send; those it did not take closed after."""
        if self._copies:
            self._sweep(spares=True)
        else:  # (nothing kept: a quick cell's send checks no copy and keeps no file)
            self.files.budget(0)
        self._made_now = set()
        try:
            yield
        finally:
            self.files.budget(0)

    def sweep(self) -> None:
        """Release the copies whose storage is gone or whose tensor has been written."""
        self._sweep(spares=False)

    def _sweep(self, spares: bool) -> None:
        """(``spares``: the files of changed copies may be kept, within the bytes of the
        copies whose storages are still there; never those of storages gone.)"""
        with self._lock:
            live = {key: copy for key, copy in self._copies.items()
                    if not copy.storage.expired()}
            self.files.budget(sum(copy.nbytes for copy in live.values()) if spares else 0)
            self._copies = {}
            for key, copy in live.items():
                if copy.changed():
                    copy.replaced()
                else:
                    self._copies[key] = copy

    def _start_sweeper(self) -> None:
        with self._lock:
            if self._sweeper is not None:
                return
            self._sweeper = threading.Thread(target=self._sweep_when_woken, daemon=True,
                                             name="nbddp-kept-sweeper")
        self._sweeper.start()

    def _sweep_when_woken(self) -> None:
        """Sweep each time a tensor that was sent is freed: a moment later, once torch
        has freed its storage (the interpreter tells while it frees the tensor, and
        torch may let this thread run before the storage goes)."""
        while True:
            self._wake.wait()
            time.sleep(SWEEP_AFTER)
            self._wake.clear()
            self.sweep()


_KERNELS_COPIES: KeptStorages | None = None
KEEP_ENV = "NBDDP_KEEP_TENSORS"
"""``0`` turns kept copies off: every send carries the tensors' bytes."""


def kernels_copies() -> KeptStorages | None:
    """This process's kept copies (made on first use); None where ``NBDDP_KEEP_TENSORS``
    is ``0``."""
    global _KERNELS_COPIES
    if os.environ.get(KEEP_ENV, "1") == "0":
        return None
    if _KERNELS_COPIES is None:
        _KERNELS_COPIES = KeptStorages()
    return _KERNELS_COPIES


@functools.cache
def _memory_limit() -> int:
    """The memory this process may use: the machine's, or its cgroup's limit if lower
    (read once: it is asked for at every new copy)."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with contextlib.suppress(OSError, ValueError):
        with open("/sys/fs/cgroup/memory.max") as cgroup:  # (cgroup v2; "max": none)
            text = cgroup.read().strip()
        if text != "max":
            limit = min(limit, int(text))
    return limit


def _forget_after_fork() -> None:
    """A child forked from the kernel (a notebook's DataLoader workers) holds none of the
    kernel's copies: they would stay in memory while it lives."""
    global _KERNELS_COPIES
    for copy in list(_ALL_COPIES):
        copy.forget()
    if _KERNELS_COPIES is not None:
        _KERNELS_COPIES.files.budget(0)  # (its spares closed)
    _KERNELS_COPIES = None


os.register_at_fork(after_in_child=_forget_after_fork)
