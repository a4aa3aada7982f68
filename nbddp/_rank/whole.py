"""Models and DTensors come back whole: unwrapped, gathered, on the CPU.

What a rank returns (or sends back with ``--out``) may hold the wrappers it trained
with: ``DistributedDataParallel``, ``torch.compile``, activation checkpointing, FSDP
(``FullyShardedDataParallel`` and ``fully_shard``), or tensors sharded as DTensors. In
the notebook it should be the user's own module with all its weights. ``make_whole``
runs on every rank once the user's code has returned. It walks the value, and the
dicts, lists and tuples (named or not) in it, not other objects, and puts in place:

- of a DDP or compiled module, the module it wraps (no copy);
- of a sharded module (FSDP, or DTensor parameters), a copy made of the user's own
  classes whose parameters and buffers are the full tensors on the CPU, gathered with
  torch's distributed-checkpoint helpers (the full state dict, on rank 0);
- of a DTensor, its full tensor on the CPU.

The rank's own objects are never changed (a session's ranks keep them for later cells).
Plain tensors and modules stay as they are: sending them copies them to the CPU.

Gathering is collective. Every rank runs ``make_whole`` on its own value, so every
rank must return the same sharded models and DTensors in the same places (code that
runs on every rank does); the other ranks' part is to take part, and what they get
back is to be dropped. A rank that returns something else leaves the others waiting
in the gather: in a one-off run its exit ends their wait with an error that says so;
in a session they wait until the run's timeout or an interrupt (whose error shows where
each rank was, and the session restarts), and a rank still gathering after
``HINT_AFTER`` seconds says what it waits for in its output.
A value without any of these costs one walk, and no communication.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

HINT_AFTER = 30.0
"""Seconds of gathering after which a rank says in its output what it is waiting for."""
_FLAT_PARAM = "_flat_param"  # FSDP1's parameter (use_orig_params=False), never the user's
_EXTRA_STATE = "_extra_state"  # in a state dict, what get_extra_state() returned
_OWN_STATE = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}
_PAIRED = {"_forward_hooks_with_kwargs": "_forward_hooks",  # keyed by the hooks' ids
           "_forward_hooks_always_called": "_forward_hooks",
           "_forward_pre_hooks_with_kwargs": "_forward_pre_hooks"}


def make_whole(value: Any, all_ranks: bool = False, name: str = "the return value") -> Any:
    """``value`` with its models and DTensors whole, on rank 0 (on every rank with
    ``all_ranks``). Call it on every rank, with each rank's own value: see the module's
    docstring. ``name`` says what ``value`` is, in errors."""
    if type(value) in _ATOMS:
        return value  # (as a walk would: a session's quick cell need not look for torch)
    kinds = _Kinds.loaded()
    if kinds is None:
        return value  # no torch, no tensors
    walk = _Walk(kinds, all_ranks)
    try:
        return walk.value(value, name)
    finally:
        if walk.hint is not None:
            walk.hint.cancel()


@dataclass(frozen=True)
class _Kinds:
    """The wrapper and tensor classes loaded in this process, each as a tuple for
    ``isinstance``: empty when never imported (then it has no instances), as nothing is
    imported to look."""

    torch: Any
    ddp: tuple[Any, ...]
    compiled: tuple[Any, ...]
    checkpointed: tuple[Any, ...]
    fsdp1: tuple[Any, ...]
    fsdp2: tuple[Any, ...]
    dtensor: tuple[Any, ...]

    @classmethod
    def loaded(cls) -> _Kinds | None:
        torch = sys.modules.get("torch")
        if torch is None:
            return None

        def find(module: str, name: str) -> tuple[Any, ...]:
            kind = getattr(sys.modules.get(module), name, None)
            return () if kind is None else (kind,)

        checkpoint = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
        return cls(torch, find("torch.nn.parallel.distributed", "DistributedDataParallel"),
                   find("torch._dynamo.eval_frame", "OptimizedModule"),
                   find(checkpoint, "ActivationWrapper"),
                   find("torch.distributed.fsdp", "FullyShardedDataParallel"),
                   find("torch.distributed.fsdp", "FSDPModule"),
                   find("torch.distributed.tensor", "DTensor"))

    def inner(self, module: Any) -> tuple[Any, bool | None]:
        """The module under ``module``'s wrappers, and (under FSDP1, whose module keeps
        its parameters in one flat parameter) whether those parameters take gradients."""
        grad = None
        while True:
            if isinstance(module, self.fsdp1):
                module = module._fsdp_wrapped_module
                flat = module._parameters.get(_FLAT_PARAM)
                grad = None if flat is None else flat.requires_grad
            elif isinstance(module, self.ddp + self.compiled + self.checkpointed):
                module = self.unwrapped(module)
            else:
                return module, grad

    def unwrapped(self, module: Any) -> Any:
        """The module under DDP, compile and checkpoint wrappers: the user's own, as is."""
        while True:
            if isinstance(module, self.ddp):
                module = module.module
            elif isinstance(module, self.compiled):
                module = module._orig_mod
            elif isinstance(module, self.checkpointed):
                module = module._checkpoint_wrapped_module
            else:
                return module

    def scan(self, module: Any) -> tuple[bool, bool]:
        """(wrappers anywhere inside ``module``, anything sharded among them)."""
        classes, todo, dtensor = set(), [module], self.dtensor
        while todo:
            sub = todo.pop()
            classes.add(type(sub))  # (checked once per class: isinstance on DDP is slow)
            if dtensor and any(isinstance(t, dtensor) for tensors in
                               (sub._parameters, sub._buffers) for t in tensors.values()):
                return True, True
            todo.extend(sub._modules.values())
        classes.discard(type(None))
        wrappers = self.ddp + self.compiled + self.checkpointed + self.fsdp1 + self.fsdp2
        sharding = self.fsdp1 + self.fsdp2
        return (any(issubclass(cls, wrappers) for cls in classes),
                any(issubclass(cls, sharding) for cls in classes))


_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
Trail = Any
"""Where a value is, for errors: the root's name, or (the parent's path, a key)."""


class _Walk:
    """One value's walk; each object is made whole once (shared ones stay shared)."""

    def __init__(self, kinds: _Kinds, all_ranks: bool) -> None:
        self.kinds, self.all_ranks = kinds, all_ranks
        self.done: dict[int, Any] = {}
        self.originals: list[Any] = []  # alive while ``done`` knows their ids
        self.hint: threading.Timer | None = None  # says what the rank waits for, if long
        self.gathered = ""  # what it gathers now

    def value(self, value: Any, path: Trail) -> Any:
        if type(value) in _ATOMS:
            return value
        kinds = self.kinds
        walk: Callable[[Any, Trail], Any]
        if isinstance(value, kinds.torch.nn.Module):
            walk = self.module
        elif isinstance(value, kinds.dtensor):
            walk = self.dtensor
        elif isinstance(value, (dict, list, tuple)):
            walk = self.container
        else:
            return value  # plain tensors, other objects
        key = id(value)
        if key not in self.done:
            self.done[key] = value  # (a container inside itself stays as it is)
            self.originals.append(value)
            self.done[key] = walk(value, path)
        return self.done[key]

    def container(self, value: Any, path: Trail) -> Any:
        """The same container (rebuilt only if something in it changed)."""
        if isinstance(value, dict):
            items = {k: self.value(v, (path, k)) for k, v in value.items()}
            if all(items[k] is v for k, v in value.items()):
                return value
            whole = copy.copy(value)  # its type and attributes (OrderedDict, defaultdict)
            whole.update(items)
            return whole
        if {type(v) for v in value} <= _ATOMS:
            return value  # (a long list of numbers: one pass)
        parts = [self.value(v, (path, i)) for i, v in enumerate(value)]
        if all(a is b for a, b in zip(parts, value, strict=True)):
            return value
        if isinstance(value, list):
            rebuilt = copy.copy(value)
            rebuilt[:] = parts
            return rebuilt
        if hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*parts)
        return type(value)(parts)

    def module(self, module: Any, path: Trail) -> Any:
        kinds = self.kinds
        module = kinds.unwrapped(module)
        wrapped, sharded = kinds.scan(module)
        if not wrapped and not sharded:
            return module
        source = _Source(kinds)
        if sharded:
            with self.gathering(path, module):
                source.gather(module, self.all_ranks)
            if not (self.all_ranks or _rank() == 0):
                return module  # this rank only took part
        return _Copier(kinds, source).copy(module, "", None)

    def dtensor(self, tensor: Any, path: Trail) -> Any:
        with self.gathering(path, tensor):
            full = tensor.full_tensor()
        if not (self.all_ranks or _rank() == 0):
            return tensor
        return _plain_tensor(self.kinds.torch, full, tensor)

    @contextlib.contextmanager
    def gathering(self, path: Trail, what: Any) -> Iterator[None]:
        """Gather (on every rank) what is sharded; say what went wrong and why, and say
        in the rank's output what it waits for if the other ranks are slow to join."""
        import torch.distributed as dist

        self.gathered = f"{_where(path)} ({type(what).__name__})"
        if not dist.is_initialized():
            raise RuntimeError(
                f"{self.gathered} is sharded across the ranks, and gathering it to send it "
                "back whole needs the process group, which is gone: return it before "
                "calling destroy_process_group()")
        if self.hint is None:
            self.hint = threading.Timer(HINT_AFTER, self._say_waiting, (dist.get_rank(),))
            self.hint.daemon = True
            self.hint.start()
        try:
            yield
        except Exception as exc:
            raise RuntimeError(
                f"rank {dist.get_rank()} could not gather {self.gathered} to send it back "
                "whole. Every rank must return the same sharded models and DTensors, in "
                "the same places (as code that runs on every rank does): a rank that "
                "returns something else ends the gather. It failed with "
                f"{type(exc).__name__}: {exc}") from exc

    def _say_waiting(self, rank: int) -> None:
        print(f"nbddp: rank {rank} is still gathering {self.gathered} after "
              f"{HINT_AFTER:g} s, to send it back whole: every rank must return it, in the "
              "same place (a rank that returned something else leaves the others waiting)",
              file=sys.stderr, flush=True)


class _Source:
    """Where a sharded module's full tensors come from: the full state dict, and the
    non-persistent buffers (which it leaves out), gathered on every rank in one order."""

    def __init__(self, kinds: _Kinds) -> None:
        self.kinds = kinds
        self.state: dict[str, Any] | None = None  # None: use the module's own tensors
        self.by_module: dict[str, dict[str, Any]] = {}
        self.extra: dict[str, Any] = {}

    def gather(self, module: Any, all_ranks: bool) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        # On rank 0 only, straight to the CPU; except for FSDP1 on the CPU, which
        # cannot (torch 2.13 frees what it would copy), and with every rank wanting it.
        offload = not all_ranks and not any(
            isinstance(sub, self.kinds.fsdp1)
            and getattr(getattr(sub, "compute_device", None), "type", None) == "cpu"
            for sub in module.modules())
        options = StateDictOptions(full_state_dict=True, cpu_offload=offload)
        self.state = get_model_state_dict(module, options=options)
        for full_name, value in self.state.items():
            prefix, _, name = full_name.rpartition(".")
            self.by_module.setdefault(prefix, {})[name] = value
        for prefix, sub in _tree(self.kinds, module, ""):
            for name in sorted(sub._non_persistent_buffers_set):
                buffer = sub._buffers.get(name)
                if isinstance(buffer, self.kinds.dtensor):
                    self.extra[prefix + name] = buffer.full_tensor()


class _Copier:
    """A plain copy of a module tree: the user's classes, full tensors, no wrappers."""

    def __init__(self, kinds: _Kinds, source: _Source) -> None:
        self.kinds, self.source = kinds, source
        self.params: dict[int, Any] = {}  # what two modules share stays shared
        self.modules: dict[int, Any] = {}

    def copy(self, module: Any, prefix: str, grad: bool | None) -> Any:
        module, flat_grad = self.kinds.inner(module)
        if id(module) in self.modules:
            return self.modules[id(module)]
        grad = grad if flat_grad is None else flat_grad
        cls: Any = _user_class(type(module), self.kinds.fsdp2)
        new = self.modules[id(module)] = cls.__new__(cls)
        params = self.parameters(module, prefix, grad)
        buffers = self.buffers(module, prefix)
        state = module.__dict__
        new.__dict__.update({k: v for k, v in state.items()
                             if not _distributed_key(k) and k not in params
                             and k not in buffers})
        new.__dict__.update(_parameters=params, _buffers=buffers, _modules={},
                            _non_persistent_buffers_set=set(module._non_persistent_buffers_set))
        for key, hooks in state.items():
            if key.endswith("hooks") and isinstance(hooks, dict):
                new.__dict__[key] = type(hooks)(
                    (i, _rebound(hook, module, new)) for i, hook in hooks.items()
                    if not _from_torch_distributed(hook))
        for key, hooks in _PAIRED.items():
            if key in state:
                new.__dict__[key] = type(state[key])(
                    (i, v) for i, v in state[key].items() if i in new.__dict__[hooks])
        for name, child in module._modules.items():
            new._modules[name] = (None if child is None
                                  else self.copy(child, f"{prefix}{name}.", grad))
        return new

    def parameters(self, module: Any, prefix: str, grad: bool | None) -> dict[str, Any]:
        torch, source = self.kinds.torch, self.source
        own = {k: v for k, v in module._parameters.items() if k != _FLAT_PARAM}
        if source.state is None:
            return own
        full = source.by_module.get(prefix[:-1], {})
        names = [*own, *(n for n in full if n not in own and n not in module._buffers
                         and n != _EXTRA_STATE)]
        params: dict[str, Any] = {}
        for name in names:
            local = own.get(name)
            if local is not None and id(local) in self.params:
                params[name] = self.params[id(local)]
            elif name in full:
                requires_grad = local.requires_grad if local is not None else grad
                params[name] = torch.nn.Parameter(full[name].detach().cpu(),
                                                  requires_grad=requires_grad is not False)
            else:
                params[name] = local  # (None: a parameter slot left empty)
            if local is not None:
                self.params[id(local)] = params[name]
        return params

    def buffers(self, module: Any, prefix: str) -> dict[str, Any]:
        source, buffers = self.source, dict(module._buffers)
        if source.state is None:
            return buffers
        full = source.by_module.get(prefix[:-1], {})
        for name in buffers:
            if name in full:
                buffers[name] = full[name].detach().cpu()
            elif prefix + name in source.extra:
                buffers[name] = source.extra[prefix + name].detach().cpu()
        return buffers


def _tree(kinds: _Kinds, module: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(prefix of its names, module) for ``module`` and all under it, wrappers skipped:
    the names of the full state dict."""
    module, _ = kinds.inner(module)
    yield prefix, module
    for name, child in module._modules.items():
        if child is not None:
            yield from _tree(kinds, child, f"{prefix}{name}.")


def _plain_tensor(torch: Any, full: Any, like: Any) -> Any:
    """``full`` on the CPU, a leaf, a ``Parameter`` if ``like`` was one."""
    full = full.detach().cpu()
    if isinstance(like, torch.nn.Parameter):
        return torch.nn.Parameter(full, requires_grad=like.requires_grad)
    return full.requires_grad_(like.requires_grad and like.is_leaf)


def _user_class(cls: type, fsdp2: tuple[Any, ...]) -> type:
    """The user's class of a module that ``fully_shard`` gave a class of its own."""
    if not issubclass(cls, fsdp2):
        return cls
    return next(base for base in cls.__mro__ if not issubclass(base, fsdp2))


def _distributed_key(key: str) -> bool:
    """An attribute that the wrappers, not the user, put on a module."""
    return (key in _OWN_STATE or key.startswith(("_fsdp", "__composable_api"))
            or key == "_is_fsdp_managed_module")


def _from_torch_distributed(hook: Any) -> bool:
    fn = getattr(hook, "__func__", hook)
    fn = getattr(fn, "func", fn)  # functools.partial
    return str(getattr(fn, "__module__", None) or "").startswith("torch.distributed")


def _rebound(hook: Any, old: Any, new: Any) -> Any:
    """``hook`` for the copy: a method of the module becomes the copy's method."""
    if getattr(hook, "__self__", None) is old:
        return types.MethodType(hook.__func__, new)
    if getattr(hook, "with_module", False) and hook.module() is old:  # torch's _WrappedHook
        return type(hook)(hook.hook, new)
    return hook


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _where(path: Trail) -> str:
    keys = []
    while isinstance(path, tuple):
        path, key = path
        keys.append(f"[{key!r}]")
    return path + "".join(reversed(keys))
