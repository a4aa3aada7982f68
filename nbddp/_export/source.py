"""The source a notebook function needs to stand alone in a script.

Starting from the function, every global it reads is classified: a module becomes an
``import``, a function or class from an importable module a ``from ... import``, a
notebook function or class its own source (followed in turn), a simple literal an
assignment, and anything else (a dataset, a tensor) data that goes into a payload file.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import textwrap
import types
from dataclasses import dataclass, field
from typing import Any

from .._wire.payload import global_names

_LITERALS = (int, float, complex, str, bytes, bool, type(None))


@dataclass
class Standalone:
    """What a script needs around the function: imports, definitions, data, in order."""

    imports: list[str] = field(default_factory=list)
    definitions: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)


def standalone(fn: types.FunctionType) -> Standalone:
    """Collect the imports, source and data ``fn`` needs (notebook definitions first)."""
    found = Standalone()
    _collect(fn, found, seen=set())
    return found


def standalone_names(namespace: dict[str, Any]) -> Standalone:
    """The same for the notebook names a cell reads (``name -> value``)."""
    found, seen = Standalone(), set[int]()
    for name, value in namespace.items():
        _classify(name, value, found, seen)
    return found


def _collect(obj: Any, found: Standalone, seen: set[int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    for name, value in _globals_read(obj).items():
        _classify(name, value, found, seen)
    found.definitions.append(source_of(obj))


def _classify(name: str, value: Any, found: Standalone, seen: set[int]) -> None:
    if isinstance(value, types.ModuleType):
        line = (f"import {value.__name__}" if value.__name__ == name
                else f"import {value.__name__} as {name}")
        _add(found.imports, line)
    elif _is_notebook_definition(value):
        _collect(value, found, seen)
    elif isinstance(value, (types.FunctionType, type)) and _importable(value):
        line = f"from {value.__module__} import {value.__qualname__}"
        _add(found.imports, line if value.__qualname__ == name else f"{line} as {name}")
    elif is_literal(value):
        _add(found.definitions, f"{name} = {value!r}")
    else:
        found.data[name] = value


def _add(lines: list[str], line: str) -> None:
    if line not in lines:
        lines.append(line)


def source_of(obj: Any) -> str:
    """The source of a function or class, dedented (a notebook's cell lines)."""
    if isinstance(obj, type) and obj.__module__ == "__main__":
        return _notebook_class_source(obj)
    return textwrap.dedent(inspect.getsource(obj)).rstrip() + "\n"


def _notebook_class_source(cls: type) -> str:
    """inspect cannot find a notebook class's source; its methods know their cell."""
    methods = [f for f in vars(cls).values() if isinstance(f, types.FunctionType)]
    if not methods:
        raise TypeError(f"cannot find the source of class {cls.__name__} (a class without "
                        "methods); define it in a module the script can import")
    code = methods[0].__code__
    lines = linecache.getlines(code.co_filename)
    for node in ast.walk(ast.parse("".join(lines))):
        if (isinstance(node, ast.ClassDef) and node.name == cls.__name__
                and node.lineno <= code.co_firstlineno <= (node.end_lineno or 0)):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            return textwrap.dedent("".join(lines[start - 1:node.end_lineno])).rstrip() + "\n"
    raise TypeError(f"cannot find the source of class {cls.__name__}")


def _globals_read(obj: Any) -> dict[str, Any]:
    """The module-level names a function (or every method of a class) reads."""
    functions = [obj] if isinstance(obj, types.FunctionType) else [
        f for f in vars(obj).values() if isinstance(f, types.FunctionType)]
    names: dict[str, Any] = {}
    for function in functions:
        scope = function.__globals__
        for name in sorted(global_names(function.__code__)):
            if name in scope:
                names[name] = scope[name]
    if isinstance(obj, type):  # base classes and decorators in the class statement
        tree = ast.parse(source_of(obj))
        scope = getattr(next(iter(functions), None), "__globals__", {})
        for node in ast.walk(tree.body[0]):
            if isinstance(node, ast.Name) and node.id in scope and node.id != obj.__name__:
                names.setdefault(node.id, scope[node.id])
    return names


def _is_notebook_definition(value: Any) -> bool:
    return isinstance(value, (types.FunctionType, type)) and value.__module__ == "__main__"


def _importable(value: Any) -> bool:
    return value.__module__ not in (None, "__main__", "builtins") and "<" not in value.__qualname__


def is_literal(value: Any) -> bool:
    """True for values whose ``repr`` is Python source that rebuilds them."""
    if isinstance(value, _LITERALS):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(is_literal(v) for v in value)
    if isinstance(value, dict):
        return all(is_literal(k) and is_literal(v) for k, v in value.items())
    return False
