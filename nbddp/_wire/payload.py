"""What crosses the process boundary: the user's function with its arguments, and values back.

Functions, lambdas and classes defined in the notebook ship by value (cloudpickle);
modules are imported by name on the ranks. When something cannot be pickled the error
names it and says why, before any process starts.
"""

from __future__ import annotations

import dis
import linecache
import os
import pickle
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle

from .._errors import PayloadError
from .dataplane import Packed, pack
from .shipped_code import CodeSent, RanksCode, install
from .tensor_pickler import Kept

#: A payload whose pickle (tensor and array bytes aside, which travel out of band) is
#: larger than this still ships, with a warning naming what made it large.
LARGE_PAYLOAD_BYTES = 100 * 2**20


class LargePayloadWarning(UserWarning):
    """A launch sends more than LARGE_PAYLOAD_BYTES to every rank."""


# Shown on every launch, not once per code location: each launch pays the cost again.
warnings.simplefilter("always", LargePayloadWarning)
_MAX_SOURCE_BYTES = 4 * 2**20


@dataclass(frozen=True)
class Payload:
    """Everything a rank needs to call the user's function."""

    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    sys_path: tuple[str, ...] = ()
    """The kernel's import path, so modules importable there import on the ranks."""
    sources: dict[str, list[str]] = field(default_factory=dict)
    """The source of the notebook cells whose code the payload carries, by code file
    name, so remote tracebacks show the lines (``dumps`` sends the cells it pickled;
    ``unpack`` fills this in on the rank)."""

    @classmethod
    def capture(cls, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Payload:
        """Bundle ``fn`` and its arguments with what the ranks need to import and report."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__} {fn!r}")
        return cls(fn, tuple(args), dict(kwargs), _import_path())

    def dumps(self, kept: Kept | None = None, code: RanksCode | None = None,
              look_at_files: bool = False) -> Packed:
        """Pickle for the ranks, tensor and array bytes out of band (large tensors by
        their ``kept`` copies, where given: for ranks on this machine); name the culprit
        if it fails, warn if the pickle itself (the pure-Python part) is huge. With
        ``code`` (ranks on nodes that may not see the notebook's files), the user's own
        modules those ranks lack go along (``_wire.shipped_code``; ``look_at_files``:
        edited ones too).

        The user's objects are pickled apart from the import path and the user's
        modules, so a rank can put both in place before it unpickles them.
        """
        try:
            body = pack((self.fn, self.args, self.kwargs), kept=kept)
        except Exception as exc:
            raise _explain_pickling_failure(self, exc) from exc
        if len(body.data) > LARGE_PAYLOAD_BYTES:
            warnings.warn(_large_payload_message(self, len(body.data)), LargePayloadWarning,
                          stacklevel=3)
        sources = _cell_sources(body.code_files)
        shipped = None if code is None else code.changes(
            self._imported_names(body.code_names), look_at_files)
        return Packed(pickle.dumps((body.data, self.sys_path, sources, shipped)),
                      body.buffers, body.owners,
                      code=None if code is None else CodeSent(code, shipped))

    def _imported_names(self, code_names: frozenset[str]) -> set[str]:
        """The top-level names the code sent by value may import: its code's names, and
        a cell's ``import`` lines (a cell travels as its source)."""
        names = {name.partition(".")[0] for name in code_names}
        imports = getattr(self.fn, "__nbddp_imports__", None)
        if imports is not None:
            names |= imports()
        return names

    @classmethod
    def unpack(cls, packed: Packed, code_home: Path | None = None) -> Payload:
        """Install the kernel's import path, the user's modules it shipped (into
        ``code_home``, the node's folder for them), and cell sources here, then unpickle
        the rest."""
        body, sys_path, sources, shipped = pickle.loads(packed.data)
        sys.path.extend(p for p in sys_path if p not in sys.path)
        if shipped is not None:
            install(shipped, code_home)
        for filename, lines in sources.items():
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        fn, args, kwargs = Packed(body, packed.buffers).load()
        return cls(fn, args, kwargs, sys_path, sources)


def _import_path() -> tuple[str, ...]:
    """The kernel's import path, absolute (folders that do not exist cost a rank
    nothing). Worked out again only when the path changed, or, where it holds a relative
    folder, the working directory: a session's every run sends it."""
    global _import_path_seen
    path = tuple(sys.path)
    seen = _import_path_seen
    if seen is not None and seen[0] == path and (
            seen[1] is None or seen[1] == os.getcwd()):
        return seen[2]
    relative = any(p and not os.path.isabs(p) for p in path)
    cwd = os.getcwd() if relative else None
    absolute = tuple(os.path.abspath(p) for p in path if p)
    _import_path_seen = (path, cwd, absolute)
    return absolute


_import_path_seen: tuple[tuple[str, ...], str | None, tuple[str, ...]] | None = None


def _cell_sources(files: frozenset[str]) -> dict[str, list[str]]:
    """The sources of those of ``files`` that are notebook cells (IPython registers
    them in linecache, with no file on disk), capped. Only the cells whose code the
    payload carries go: every cell of a long notebook, with each run, would cost
    milliseconds (a rank keeps what earlier runs of a session brought)."""
    sources, total = {}, 0
    for filename in sorted(files):
        entry = linecache.cache.get(filename)
        if entry is None or len(entry) != 4 or entry[1] is not None \
                or os.path.exists(filename):
            continue
        total += entry[0]
        if total > _MAX_SOURCE_BYTES:
            break
        sources[filename] = list(entry[2])
    return sources


def _captured(payload: Payload) -> Iterator[tuple[str, Any]]:
    """The parts of a payload a user would recognise, each with a name for messages."""
    yield from _captured_by_function(payload.fn)
    for i, arg in enumerate(payload.args):
        yield f"args[{i}]", arg
    for key, value in payload.kwargs.items():
        yield f"kwargs[{key!r}]", value


def _captured_by_function(fn: Any) -> Iterator[tuple[str, Any]]:
    if hasattr(fn, "__nbddp_captured__"):  # e.g. a notebook cell: its names
        yield from fn.__nbddp_captured__()
        return
    fn = getattr(fn, "__func__", fn)  # bound methods: look at the function
    if not isinstance(fn, types.FunctionType):
        yield "fn", fn
        return
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        try:
            yield f"{name!r} (captured by {fn.__name__})", cell.cell_contents
        except ValueError:  # empty cell
            continue
    for name in sorted(global_names(fn.__code__)):
        if name in fn.__globals__:
            yield f"global {name!r} (used by {fn.__name__})", fn.__globals__[name]
    for i, value in enumerate(fn.__defaults__ or ()):
        yield f"default argument {i} of {fn.__name__}", value


#: The instructions that name a global: a function's loads, stores and deletes, and a
#: class body's loads (``LOAD_NAME`` falls back to the globals; 3.12 adds a variant).
_GLOBAL_OPS = frozenset(dis.opmap[name] for name in (
    "LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS",
) if name in dis.opmap)


def global_names(code: types.CodeType) -> set[str]:
    """Names a code object (and the functions, lambdas, classes and comprehensions
    nested in it) reads or binds as globals: those its global-name instructions name, as
    cloudpickle finds them. ``co_names`` would also hold attribute and imported names:
    ``model.train()`` reads no global ``train``. Dunder names are left out: a class
    body's ``__module__ = __name__`` is the compiler's, not the user's."""
    names = {op.argval for op in dis.get_instructions(code) if op.opcode in _GLOBAL_OPS
             and not (op.argval.startswith("__") and op.argval.endswith("__"))}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names


def _explain_pickling_failure(payload: Payload, exc: Exception) -> PayloadError:
    for name, value in _captured(payload):
        try:
            cloudpickle.dumps(value)
        except Exception as part_exc:
            return PayloadError(
                f"cannot send {name} to the ranks: it cannot be pickled "
                f"({type(part_exc).__name__}: {part_exc}). Create it inside the function, "
                "or pass something picklable (a path, a config) instead."
            )
    return PayloadError(f"cannot send the function to the ranks: {type(exc).__name__}: {exc}")


def _large_payload_message(payload: Payload, size: int) -> str:
    sizes = []
    for name, value in _captured(payload):
        try:
            sizes.append((len(pack(value).data), name))
        except Exception:
            continue
    largest = ", ".join(f"{name} ({n / 2**20:.0f} MB)" for n, name in sorted(sizes)[::-1][:3])
    return (f"nbddp payload is {size / 2**20:.0f} MB of pickled Python objects, which slows "
            f"every launch; largest parts: {largest}. Tensors and NumPy arrays cost nothing "
            "here (their bytes are shared, not pickled): keep large data in them, or load it "
            "inside the function.")


def dumps_value(value: Any) -> bytes:
    """Pickle a value for the kernel in one piece (an exception, a small result), with
    tensors moved to the CPU (the kernel has no GPU)."""
    packed = pack(value, to_cpu=True, out_of_band=False)
    return packed.data


def loads_value(data: bytes) -> Any:
    return cloudpickle.loads(data)
