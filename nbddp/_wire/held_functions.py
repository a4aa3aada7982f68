"""Notebook functions a session's ranks hold: pickled whole once, then by number.

cloudpickle sends a notebook function by value: its code, its names, the base of its
globals, and what may change between calls (the globals it reads, its defaults, closure
values and attributes). A session calls the same functions cell after cell; pickling
and rebuilding their code with every call was most of what a call by value cost beyond
a call by reference (``benchmarks/README.md``). So the kernel keeps, for the ranks of
one session, which functions' code it taught them (``RanksFunctions``), and each rank
keeps what it was taught (``_HELD``). A function the ranks hold goes as its number and
the parts that may change, pickled afresh with every call, as cloudpickle would.

A number goes only once every rank holds it: the kernel counts a function as taught
when a run that carried it whole returned on every rank. A run that failed, fresh
ranks (a new ``RanksFunctions``), or a run on some ranks only teach nothing: the
function goes whole again, which is harmless. A rank told a number it does not hold
says so (a defect of this bookkeeping, not the user's).
"""

from __future__ import annotations

import builtins
import itertools
import types
from collections.abc import Iterable
from typing import Any

from cloudpickle import cloudpickle as _cloudpickle

# (Private to cloudpickle, in every version this package allows, 2.2 to 3.1): the names
# a code object reads as globals, which cloudpickle sends the values of. A held function
# sends the same names, so a call cannot pickle more, or less, than cloudpickle would.
_global_names = _cloudpickle._extract_code_globals

_BASE_GLOBALS = ("__package__", "__name__", "__path__", "__file__")
"""The module attributes a function's globals start with on the rank (cloudpickle's)."""

Constants = tuple[str, str, str, Any]
"""What a held function keeps between calls: its name, qualified name, module, doc."""


def constants_of(fn: types.FunctionType) -> Constants:
    return fn.__name__, fn.__qualname__, fn.__module__, fn.__doc__


class RanksFunctions:
    """(In the kernel) The notebook functions one set of ranks holds, by code object:
    the number each was taught under, and which numbers every rank is known to hold."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[types.CodeType, int, Constants, tuple[str, ...]]] = {}
        """By ``id`` of code (which the entry keeps alive): the code, its number, the
        constants it was taught with, the global names it reads."""
        self._held: set[int] = set()
        self._numbers = itertools.count(1)

    def held(self, fn: types.FunctionType) -> tuple[int, tuple[str, ...]] | None:
        """``fn``'s number and the global names it reads, if every rank holds its code
        with the same constants; else None (it goes whole)."""
        code = fn.__code__
        entry = self._known.get(id(code))
        if entry is None or entry[0] is not code or entry[1] not in self._held \
                or entry[2] != constants_of(fn):
            return None
        return entry[1], entry[3]

    def number_for(self, fn: types.FunctionType) -> int:
        """The number under which ``fn``'s code is taught (a new one if its constants
        changed since)."""
        code, constants = fn.__code__, constants_of(fn)
        entry = self._known.get(id(code))
        if entry is None or entry[0] is not code or entry[2] != constants:
            entry = (code, next(self._numbers), constants, tuple(_global_names(code)))
            self._known[id(code)] = entry
        return entry[1]

    def taught(self, numbers: Iterable[int]) -> None:
        """Every rank took a payload that taught ``numbers``: they may go by number."""
        self._held.update(numbers)


# --- pickling (in the kernel) ---------------------------------------------------------


def teaching(number: int, fn: types.FunctionType, reduced: tuple[Any, ...]) -> tuple[Any, ...]:
    """cloudpickle's whole reduction of ``fn`` (``reduced``), which also leaves its code
    and constants with the rank under ``number``."""
    make, args, *rest = reduced
    return (learned, (number, constants_of(fn), make, args), *rest)


def by_number(number: int, names: tuple[str, ...], fn: types.FunctionType,
              base_globals: dict[str, Any]) -> tuple[Any, ...]:
    """``fn``, whose code the ranks hold, as its number and what may have changed since
    (its state, set after the function is made, so that it may refer to the function).
    ``base_globals``: the pickle's one dict for functions of ``fn``'s globals (as
    cloudpickle shares them): they share it on the rank too."""
    if not base_globals:
        base_globals.update((k, fn.__globals__[k]) for k in _BASE_GLOBALS
                            if k in fn.__globals__)
    reads = {k: fn.__globals__[k] for k in names if k in fn.__globals__}
    closure = None if fn.__closure__ is None else tuple(map(_contents, fn.__closure__))
    state = (reads, fn.__defaults__, fn.__kwdefaults__, closure, fn.__dict__ or None,
             fn.__annotations__ or None)  # (a new function's own are empty: nothing to set)
    cells = 0 if closure is None else len(closure)
    return held_function, (number, base_globals, cells), state, None, None, refill


class _Empty:
    """An empty closure cell's value (a name the enclosing function binds later)."""


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _Empty


# --- unpickling (on the rank) ---------------------------------------------------------

_HELD: dict[int, tuple[types.CodeType, Constants]] = {}
"""(On a rank) The code and constants of each function this rank was taught, by number."""


def learned(number: int, constants: Constants, make: Any, args: tuple[Any, ...]) -> Any:
    """Make the function as cloudpickle does, and keep its code under ``number``."""
    fn = make(*args)
    _HELD[number] = (fn.__code__, constants)
    return fn


def held_function(number: int, base_globals: dict[str, Any], cells: int) -> types.FunctionType:
    """The function held as ``number``, in ``base_globals``, its state still to come."""
    try:
        code, (name, qualname, module, doc) = _HELD[number]
    except KeyError:
        raise RuntimeError(
            f"nbddp: this rank does not hold notebook function #{number}, which the kernel "
            "counted as taught to every rank: a defect of nbddp; restart the session") from None
    base_globals["__builtins__"] = builtins
    closure = tuple(types.CellType() for _ in range(cells)) if cells else None
    fn = types.FunctionType(code, base_globals, name, None, closure)
    fn.__qualname__, fn.__module__, fn.__doc__ = qualname, module, doc
    return fn


def refill(fn: types.FunctionType, state: tuple[Any, ...]) -> None:
    """Set what a held function's call brought: the globals it reads, its defaults,
    closure values, attributes and annotations."""
    reads, defaults, kwdefaults, closure, attributes, annotations = state
    fn.__globals__.update(reads)
    if defaults is not None:
        fn.__defaults__ = defaults
    if kwdefaults is not None:
        fn.__kwdefaults__ = kwdefaults
    for cell, value in zip(fn.__closure__ or (), closure or (), strict=True):
        if value is not _Empty:
            cell.cell_contents = value
    if attributes is not None:
        fn.__dict__.update(attributes)
    if annotations is not None:
        fn.__annotations__ = annotations
