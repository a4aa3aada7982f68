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
import sys
import types
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from cloudpickle import cloudpickle as _cloudpickle

if TYPE_CHECKING:
    from .shipped_code import CodeSent

# (Private to cloudpickle, in every version this package allows, 2.2 to 3.1.) A held
# function's call sends the values of the globals its code reads, as cloudpickle's would.
_global_names = _cloudpickle._extract_code_globals

_BASE_GLOBALS = ("__package__", "__name__", "__path__", "__file__")
"""The module attributes a function's globals start with on the rank (cloudpickle's)."""

Constants = tuple[str, str, str, Any]
"""What a held function keeps between calls: its name, qualified name, module, doc."""


def constants_of(fn: types.FunctionType) -> Constants:
    """What of ``fn`` the ranks keep with its code (a change sends it whole again)."""
    return fn.__name__, fn.__qualname__, fn.__module__, fn.__doc__


@dataclass
class _Code:
    """(In the kernel) One code object taught to the ranks: under a number for each set
    of constants it came with (the functions a decorator makes share its code, each with
    the name and doc of the function it wraps)."""

    code: types.CodeType  # (kept alive: the key is its id)
    reads: tuple[str, ...]
    """The global names the code reads."""
    numbers: dict[Constants, int] = field(default_factory=dict)
    _submodules: tuple[Hashable, list[types.ModuleType]] | None = field(
        default=None, init=False, repr=False)

    def submodules(self, values: Iterable[Any]) -> list[types.ModuleType]:
        """``imported_submodules`` of this code and ``values``, found again only when
        the modules among them, or the number of modules imported here, changed."""
        modules = tuple(v for v in values if isinstance(v, types.ModuleType))
        if not modules:
            return []
        key = (tuple(map(id, modules)), len(sys.modules))
        found = self._submodules
        if found is None or found[0] != key:
            found = self._submodules = (key, imported_submodules(self.code, modules))
        return found[1]


class RanksFunctions:
    """(In the kernel) The notebook functions one set of ranks holds, by code object:
    the number each was taught under, and which numbers every rank is known to hold."""

    def __init__(self) -> None:
        self._known: dict[int, _Code] = {}
        """Each code object taught, by its ``id``."""
        self._held: set[int] = set()
        self._numbers = itertools.count(1)

    def held(self, fn: types.FunctionType) -> tuple[int, _Code] | None:
        """``fn``'s number and its code's entry, if every rank holds its code with the
        same constants; else None (it goes whole)."""
        known = self._entry(fn.__code__)
        if known is None:
            return None
        try:
            number = known.numbers.get(constants_of(fn))
        except TypeError:  # a doc that is not a string, and cannot be hashed: whole
            return None
        return (number, known) if number in self._held else None

    def number_for(self, fn: types.FunctionType) -> int | None:
        """The number under which ``fn``'s code is taught (a new one for code, or
        constants, not taught before); None if it cannot be kept (an unhashable doc)."""
        code = fn.__code__
        known = self._entry(code)
        if known is None:
            known = self._known[id(code)] = _Code(code, tuple(_global_names(code)))
        try:
            return known.numbers.setdefault(constants_of(fn), next(self._numbers))
        except TypeError:
            return None

    def _entry(self, code: types.CodeType) -> _Code | None:
        """``code``'s entry, if it was taught (not another's that had its ``id``)."""
        known = self._known.get(id(code))
        return known if known is not None and known.code is code else None

    def taught(self, numbers: Iterable[int]) -> None:
        """Every rank took a payload that taught ``numbers``: they may go by number."""
        self._held.update(numbers)


class Teaching(NamedTuple):
    """What one payload teaches which ranks, kept until its run's end (not the payload,
    whose data the run's ``Job`` would keep alive): functions, and the user's module
    files (``shipped_code``)."""

    functions: RanksFunctions | None
    numbers: frozenset[int]
    code: CodeSent | None = None

    def confirm(self) -> None:
        """Every rank returned from the run, so each took the payload whole: what it
        taught is held."""
        if self.functions is not None:
            self.functions.taught(self.numbers)
        if self.code is not None:
            self.code.confirm()


# --- pickling (in the kernel) ---------------------------------------------------------


def whole(number: int, fn: types.FunctionType, reduced: tuple[Any, ...]) -> tuple[Any, ...]:
    """cloudpickle's whole reduction of ``fn`` (``reduced``), which also leaves its code
    and constants with the rank under ``number``."""
    make, args, *rest = reduced
    return (learned, (number, constants_of(fn), make, args), *rest)


def by_number(number: int, known: _Code, fn: types.FunctionType,
              base_globals: dict[str, Any]) -> tuple[Any, ...]:
    """``fn``, whose code the ranks hold, as its number and what may have changed since
    (its state, set after the function is made, so that it may refer to the function).
    ``base_globals``: the pickle's one dict for functions of ``fn``'s globals (as
    cloudpickle shares them): they share it on the rank too."""
    if not base_globals:
        base_globals.update((k, fn.__globals__[k]) for k in _BASE_GLOBALS
                            if k in fn.__globals__)
    reads = {k: fn.__globals__[k] for k in known.reads if k in fn.__globals__}
    closure = None if fn.__closure__ is None else tuple(map(_contents, fn.__closure__))
    imports = known.submodules(itertools.chain(reads.values(), closure or ()))
    state = (reads, fn.__defaults__, fn.__kwdefaults__, closure, fn.__dict__ or None,
             fn.__annotations__ or None,  # (a new function's own are empty: nothing to set)
             imports or None)
    cells = 0 if closure is None else len(closure)
    return held_function, (number, base_globals, cells), state, None, None, refill


def imported_submodules(code: types.CodeType, values: Iterable[Any]) -> list[types.ModuleType]:
    """The submodules, imported in this process, of the packages among ``values`` that
    ``code`` can reach by attribute (``torch.nn.functional``: each part a name the code
    uses), which a rank must import (by unpickling them) before the call: the modules
    cloudpickle sends with a function by value. Found by looking up each name under each
    package, not by reading all of ``sys.modules`` for each package, as cloudpickle does:
    that took a millisecond a call for a function using ``torch``."""
    names = set(code.co_names)
    found: list[types.ModuleType] = []
    packages = [v.__name__ for v in values
                if isinstance(v, types.ModuleType) and getattr(v, "__package__", None)]
    while packages:
        prefix = packages.pop()
        for name in names:
            submodule = sys.modules.get(f"{prefix}.{name}")
            if isinstance(submodule, types.ModuleType):
                found.append(submodule)
                if hasattr(submodule, "__path__"):  # (a package: its own may be in use)
                    packages.append(f"{prefix}.{name}")
    return found


class _Empty:
    """An empty closure cell's value (a name the enclosing function binds later)."""


def _contents(cell: types.CellType) -> Any:
    """A closure cell's value, or ``_Empty``."""
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
    closure values, attributes and annotations (the submodules it uses are imported by
    now: they were unpickled)."""
    reads, defaults, kwdefaults, closure, attributes, annotations, _ = state
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
