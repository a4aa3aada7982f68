"""How ``dataplane.pack`` pickles: cloudpickle, protocol 5, with tensors as their storages'
bytes.

A storage is pickled once however many tensors share it (views come back as views), as a
buffer that can leave the pickle out of band; a CUDA tensor's bytes cross as a CPU
tensor's would and are loaded onto the receiving rank's own GPU; a large storage may go
by its kept copy instead (``Kept``: ``_wire.kept_storages``). The pickler also notes the
files of the code it carries (``_wire.code_files``).

The functions here that rebuild what it pickled are named in each pickle by this module's
path: the kernel and the ranks run the same nbddp.
"""

from __future__ import annotations

import ctypes
import functools
import io
import os
import pickle
import sys
import types
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import cloudpickle

from . import code_files


class Kept(Protocol):
    """Copies of large storages kept from one send to the next (``kept_storages``)."""

    def sending(self) -> AbstractContextManager[None]:
        """Around one send."""

    def copy_of(self, tensor: Any, storage: Any) -> Any:
        """The copy to pickle for ``tensor``'s storage, or None to send its bytes."""

    def seen_with(self, copy: Any, tensor: Any) -> None:
        """``tensor`` is another on a storage already pickled as ``copy``."""


class _StorageBox:
    """One tensor storage: pickled once however many tensors share it, as a buffer."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage

    def __reduce__(self) -> tuple[Any, ...]:
        size = self.storage.nbytes()
        if size == 0:
            return storage_from_buffer, (b"",)
        raw = (ctypes.c_ubyte * size).from_address(self.storage.data_ptr())
        return storage_from_buffer, (pickle.PickleBuffer(memoryview(raw).cast("B")),)


def storage_from_buffer(buffer: Any) -> Any:
    """A tensor storage over ``buffer``'s memory (which it keeps alive)."""
    import torch

    if not len(memoryview(buffer)):
        return torch.UntypedStorage(0)
    return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()


def _tensor(storage: Any, dtype: Any, size: Sequence[int], stride: Sequence[int],
            offset: int, requires_grad: bool) -> Any:
    import torch

    tensor = torch.empty((0,), dtype=dtype, device=storage.device).set_(
        storage, offset, size, stride)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _parameter(storage: Any, dtype: Any, size: Sequence[int], stride: Sequence[int],
               offset: int, requires_grad: bool, state: Any) -> Any:
    """A ``Parameter`` as torch rebuilds one (pickled with its own tensor, whose version
    counter is the one its in-place updates bump; ``.data`` would have a fresh one)."""
    from torch._utils import _rebuild_parameter_with_state

    tensor = _tensor(storage, dtype, size, stride, offset, False)
    return _rebuild_parameter_with_state(tensor, requires_grad, OrderedDict(), state)


def _identity(value: Any) -> Any:
    return value


def _plain(tensor: Any) -> bool:
    """A dense CPU tensor whose bytes are all there is to it."""
    return tensor.device.type == "cpu" and _dense(tensor)


def _dense(tensor: Any) -> bool:
    """A dense tensor (on any device) whose bytes are all there is to it."""
    import torch

    return (type(tensor) is torch.Tensor  # a Parameter pickles its .data, which is plain
            and tensor.layout == torch.strided
            and not tensor.is_quantized and not tensor.is_conj() and not tensor.is_neg()
            and not (tensor.requires_grad and tensor.grad_fn is not None))


class _OnRankDevice:
    """A CUDA storage's bytes, to be loaded onto the receiving rank's own GPU (once,
    however many tensors share it: pickle keeps one copy of this object)."""

    def __init__(self, box: _StorageBox) -> None:
        self.box = box

    def __reduce__(self) -> tuple[Any, ...]:
        return storage_on_rank_device, (self.box,)


def storage_on_rank_device(storage: Any) -> Any:
    """``storage`` (on the CPU) moved to this rank's GPU, ``cuda:LOCAL_RANK``, the one
    the rank's process group uses; left on the CPU where this process has no such GPU
    (a CPU rank, or the kernel loading what it sent)."""
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", "-1"))
    if not torch.cuda.is_available() or not 0 <= local_rank < torch.cuda.device_count():
        return storage
    return storage.to(device=f"cuda:{local_rank}")


class TensorPickler(cloudpickle.Pickler):
    """cloudpickle, protocol 5, with tensors as their storage's bytes out of band,
    and code objects under their real file names (``code_files``), which it notes."""

    def __init__(self, stream: io.BytesIO, to_cpu: bool, keep: Any,
                 kept: Kept | None) -> None:
        super().__init__(stream, protocol=5, buffer_callback=keep)
        self._to_cpu = to_cpu
        self._kept = kept
        self.storages: dict[tuple[Any, ...], Any] = {}
        """Each storage pickled: its ``_StorageBox``, or its kept copy."""
        self.code_files: set[str] = set()
        self.code_names: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is types.FunctionType and obj in _rebuilders():
            return NotImplemented  # (by name)
        if type(obj) is types.CodeType:
            self.code_files.add(obj.co_filename)
            self.code_names.update(obj.co_names)
            return code_files.reduce_code(obj)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            if self._to_cpu and obj.device.type not in ("cpu", "meta"):
                return _identity, (obj.cpu(),)
            if obj.device.type == "cuda" and _dense(obj):
                return _tensor, self._cuda_tensor_args(obj) + (obj.requires_grad,)
            if _plain(obj):
                return _tensor, self._tensor_args(obj) + (obj.requires_grad,)
            if type(obj) is torch.nn.Parameter and _plain(obj.detach()):
                return _parameter, self._tensor_args(obj) + (
                    obj.requires_grad, torch._utils._get_obj_state(obj))
        return super().reducer_override(obj)

    def _tensor_args(self, tensor: Any) -> tuple[Any, ...]:
        """How ``_tensor`` rebuilds ``tensor``: its storage, dtype, size, stride, offset."""
        return (self._box(tensor, tensor.untyped_storage()), tensor.dtype,
                tuple(tensor.size()), tensor.stride(), tensor.storage_offset())

    def _cuda_tensor_args(self, tensor: Any) -> tuple[Any, ...]:
        """How ``_tensor`` rebuilds a CUDA ``tensor`` on the receiving rank's own GPU: its
        storage's bytes cross like a CPU tensor's (copied to the CPU once, however many
        tensors share it), and are moved to that rank's device as they are loaded."""
        storage = tensor.untyped_storage()
        key = ("cuda", storage.device.index, storage.data_ptr(), storage.nbytes())
        if key not in self.storages:
            self.storages[key] = _OnRankDevice(_StorageBox(storage.cpu()))
        return (self.storages[key], tensor.dtype, tuple(tensor.size()), tensor.stride(),
                tensor.storage_offset())

    def _box(self, tensor: Any, storage: Any) -> Any:
        """How ``storage`` (``tensor``'s) is pickled: by its kept copy where there is
        one, else as its bytes; once, however many tensors share it."""
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self.storages:
            copy = None if self._kept is None else self._kept.copy_of(tensor, storage)
            self.storages[key] = copy if copy is not None else _StorageBox(storage)
        elif self._kept is not None:
            self._kept.seen_with(self.storages[key], tensor)
        return self.storages[key]


@functools.cache
def _rebuilders() -> frozenset[types.FunctionType]:
    """The module-level functions of cloudpickle, of this module and of ``code_files``,
    which go by their names: among them, those our pickles call to rebuild what they
    hold. cloudpickle asks of every function it meets whether it may go by name, by
    looking it up in its module; these are answered from one set. (Only those found again
    by their names: an alias whose name was rebound goes as cloudpickle would send it.)"""
    return frozenset(
        fn for module in (cloudpickle.cloudpickle, code_files, sys.modules[__name__])
        for name, fn in vars(module).items()
        if type(fn) is types.FunctionType and fn.__module__ == module.__name__
        and fn.__qualname__ == name)
