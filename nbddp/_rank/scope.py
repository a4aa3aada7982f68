"""Where notebook code runs on a rank: one global namespace, and whose each name is.

A cell runs in a scope's globals. The notebook names it reads arrive by value with the
payload. Notebook functions and classes among them were pickled with globals of their
own (cloudpickle's), so they are rebound to the scope's: a function defined in the
notebook sees what the cell assigns, as it would in the notebook.

In a session the scope outlives the cell. Names that session code assigned (variables,
models, the functions its cells define, its imports) are the ranks' own: a notebook
value of the same name does not replace them. Every other name is the notebook's, and
arrives afresh with each cell that reads it.
"""

from __future__ import annotations

import builtins
import contextlib
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any


class Scope:
    """A rank's global namespace for notebook code, and the names its own code assigned."""

    def __init__(self) -> None:
        self.globals: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self.assigned: set[str] = set()
        """Names that code run here bound (in a session: the ranks' own names)."""
        self._brought: dict[str, Any] = {}  # what ``take`` put in, which code did not bind

    def take(self, values: Mapping[str, Any], code: Iterable[Any] = ()) -> list[dict[str, Any]]:
        """Bring in notebook names (the scope's own names win), with the notebook code
        among them, or in ``code``, and what it refers to, rebound to this scope."""
        foreign = _foreign_globals([*values.values(), *code])
        incoming = dict(values)
        for their_globals in foreign:
            for name, value in their_globals.items():
                if not name.startswith("__"):
                    incoming.setdefault(name, value)
        for name, value in incoming.items():
            if name not in self.assigned:
                self.globals[name] = self._brought[name] = _rebind(value, foreign, self.globals)
        return foreign

    def restore(self, values: Mapping[str, Any]) -> None:
        """Put back names this scope's code had bound (a snapshot's, on fresh ranks): the
        rank's own again, their notebook code rebound to this scope."""
        foreign = _foreign_globals(values.values())
        for name, value in values.items():
            self.globals[name] = _rebind(value, foreign, self.globals)
        self.assigned |= set(values)

    def bind(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a notebook function) running in this scope, with what it refers to."""
        return _rebind(fn, self.take({}, code=[fn]), self.globals)

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Note which names the code run inside binds or deletes (not those ``take``
        brings in from the notebook)."""
        before, self._brought = dict(self.globals), {}
        try:
            yield
        finally:
            now, brought = self.globals, self._brought
            self.assigned |= {name for name, value in now.items()
                              if (name not in before or before[name] is not value)
                              and not (name in brought and brought[name] is value)}
            self.assigned -= {name for name in before if name not in now}


def _foreign_globals(values: Any) -> list[dict[str, Any]]:
    """The globals dicts of notebook code (pickled by value) among ``values``."""
    found: dict[int, dict[str, Any]] = {}
    for value in values:
        for fn in _functions_of(value):
            g = fn.__globals__
            module = sys.modules.get(g.get("__name__", ""))
            if module is None or g is not vars(module):
                found[id(g)] = g
    return list(found.values())


def _functions_of(value: Any) -> Iterator[types.FunctionType]:
    if isinstance(value, types.FunctionType):
        yield value
    elif isinstance(value, type):
        for attribute in vars(value).values():
            yield from _unwrapped(attribute)


def _unwrapped(attribute: Any) -> Iterator[types.FunctionType]:
    """The functions inside a class attribute: a method, static/class method, property."""
    if isinstance(attribute, types.FunctionType):
        yield attribute
    elif isinstance(attribute, (staticmethod, classmethod)):
        yield from _unwrapped(attribute.__func__)
    elif isinstance(attribute, property):
        for part in (attribute.fget, attribute.fset, attribute.fdel):
            yield from _unwrapped(part)


def _rebind(value: Any, foreign: list[dict[str, Any]], scope: dict[str, Any]) -> Any:
    """``value`` with its notebook code's globals replaced by ``scope``."""
    if isinstance(value, types.FunctionType):
        return _with_globals(value, foreign, scope)
    if isinstance(value, type) and any(
            fn.__globals__ is g for fn in _functions_of(value) for g in foreign):
        for name, attribute in list(vars(value).items()):
            rebound = _rebind_attribute(attribute, foreign, scope)
            if rebound is not attribute:
                setattr(value, name, rebound)
    return value


def _rebind_attribute(attribute: Any, foreign: list[dict[str, Any]],
                      scope: dict[str, Any]) -> Any:
    if isinstance(attribute, types.FunctionType):
        return _with_globals(attribute, foreign, scope)
    if isinstance(attribute, (staticmethod, classmethod)):
        inner = _rebind_attribute(attribute.__func__, foreign, scope)
        return attribute if inner is attribute.__func__ else type(attribute)(inner)
    if isinstance(attribute, property):
        parts = [_rebind_attribute(p, foreign, scope) if p is not None else None
                 for p in (attribute.fget, attribute.fset, attribute.fdel)]
        return property(parts[0], parts[1], parts[2], attribute.__doc__)
    return attribute


def _with_globals(fn: types.FunctionType, foreign: list[dict[str, Any]],
                  scope: dict[str, Any]) -> types.FunctionType:
    if not any(fn.__globals__ is g for g in foreign):
        return fn
    rebound = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__,
                                 fn.__closure__)
    rebound.__kwdefaults__ = fn.__kwdefaults__
    rebound.__qualname__, rebound.__module__ = fn.__qualname__, fn.__module__
    rebound.__doc__, rebound.__annotations__ = fn.__doc__, fn.__annotations__
    rebound.__dict__.update(fn.__dict__)
    return rebound
