"""Which notebook names a cell reads, by Python's own scoping rules.

What this finds is what ships with the cell: a name it misses fails on the ranks with
NameError, a name it finds wrongly ships a notebook value the cell never reads (and
fails the launch if that value cannot be pickled). The cell's top level runs in order,
so a name counts where it is read before the cell binds it; code in functions and
lambdas runs later, so what it reads counts unless the cell binds it anywhere.
Parameters, locals, comprehension variables and a class body's names are their own
scope's, as the compiler decides them.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from typing import Any

SOURCES_KEPT = 128
"""Distinct cells whose names are kept: a notebook runs the same cells again (in a
session, often), and a cell's names follow from its source alone."""


@functools.lru_cache(maxsize=SOURCES_KEPT)
def names_read_in(source: str, filename: str) -> tuple[str, ...]:
    """``names_read_from_outside`` of the cell ``source``, sorted (a SyntaxError names
    ``filename``), worked out once per cell."""
    return tuple(sorted(names_read_from_outside(ast.parse(source, filename))))


def names_read_from_outside(tree: ast.Module) -> set[str]:
    """Names the cell reads before (or without) binding them itself: ``total += 1``
    reads ``total``; ``[z for z in xs]`` reads ``xs`` and not ``z``."""
    flow = _NameFlow()
    flow.visit(tree)
    return flow.read_first | (flow.read_later - flow.bound)


@dataclass
class _Scope:
    """A scope inside the cell: a function (or lambda), a class body or a comprehension."""

    kind: str
    bound: set[str]
    """Its names: all of a function's or comprehension's up front (the compiler decides
    them), a class body's as it binds them (it runs top to bottom)."""
    declared_global: set[str] = field(default_factory=set)


class _NameFlow(ast.NodeVisitor):
    """Walks a cell in the order Python evaluates it, inside the scopes it opens, noting
    the globals read before the cell binds them and those functions read later."""

    def __init__(self) -> None:
        self.scopes: list[_Scope] = []
        self.bound: set[str] = set()
        """The cell's globals bound so far."""
        self.read_first: set[str] = set()
        self.read_later: set[str] = set()

    def read(self, name: str) -> None:
        for depth, scope in enumerate(reversed(self.scopes)):
            if scope.kind == "class" and depth > 0:
                continue  # a class body's names are not visible to code nested in it
            if name in scope.declared_global:
                break
            if name in scope.bound:
                return
        if any(scope.kind == "function" for scope in self.scopes):
            self.read_later.add(name)
        elif name not in self.bound:
            self.read_first.add(name)

    def bind(self, name: str, walrus: bool = False) -> None:
        """Bind where Python binds: the innermost scope (for ``:=`` the innermost one
        that is no comprehension); functions' and comprehensions' names are known."""
        scopes = [s for s in self.scopes if not (walrus and s.kind == "comprehension")]
        if not scopes:
            self.bound.add(name)
        elif scopes[-1].kind == "class" and name not in scopes[-1].declared_global:
            scopes[-1].bound.add(name)
        elif scopes[-1].kind == "class" and not any(s.kind == "function" for s in scopes):
            self.bound.add(name)  # ``global`` in a class body that runs now

    def visit_Name(self, node: ast.Name) -> None:
        if not isinstance(node.ctx, ast.Store):  # ``del x`` needs an ``x`` too
            self.read(node.id)
        if not isinstance(node.ctx, ast.Load):
            self.bind(node.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        self._visit_all([node.value, *node.targets])

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.target, ast.Name):
            self.read(node.target.id)  # ``total += 1`` reads ``total`` first
        self._visit_all([node.target, node.value])

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.visit(node.annotation)
        if node.value is not None:
            self._visit_all([node.value, node.target])
        elif not isinstance(node.target, ast.Name):  # ``a.b: int`` evaluates ``a``
            self.visit(node.target)

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self._visit_all([node.iter, node.target, *node.body, *node.orelse])

    visit_AsyncFor = visit_For

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self.bind(node.target.id, walrus=True)

    def visit_Import(self, node: ast.Import | ast.ImportFrom | ast.MatchStar) -> None:
        for name in _binds(node):
            self.bind(name)

    visit_ImportFrom = visit_MatchStar = visit_Import

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.type is not None:
            self.visit(node.type)
        for name in _binds(node):
            self.bind(name)
        self._visit_all(node.body)

    def visit_MatchAs(self, node: ast.MatchAs | ast.MatchMapping) -> None:
        self.generic_visit(node)
        for name in _binds(node):
            self.bind(name)

    visit_MatchMapping = visit_MatchAs

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._visit_all(_outer_parts(node))
        self._inside(_function_scope(node), node.body)
        self.bind(node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._visit_all(_outer_parts(node))
        self._inside(_function_scope(node), [node.body])

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._visit_all(_outer_parts(node))
        self._inside(_Scope("class", set(), _bindings(list(node.body))[1]), node.body)
        self.bind(node.name)

    def visit_ListComp(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp) -> None:
        self._comprehension(node, [node.elt])

    visit_SetComp = visit_GeneratorExp = visit_ListComp

    def visit_DictComp(self, node: ast.DictComp) -> None:
        self._comprehension(node, [node.key, node.value])

    def _comprehension(self, node: _Comprehension, results: list[ast.expr]) -> None:
        """The first iterable is evaluated outside; the loop variables are the
        comprehension's own, each bound before the parts that follow read it."""
        self._visit_all(_outer_parts(node))
        parts: list[ast.AST] = []
        for i, generator in enumerate(node.generators):
            parts += [generator.iter] if i else []
            parts += [generator.target, *generator.ifs]
        targets = {n.id for g in node.generators for n in ast.walk(g.target)
                   if isinstance(n, ast.Name)}
        self._inside(_Scope("comprehension", targets), parts + results)

    def _inside(self, scope: _Scope, nodes: list[Any]) -> None:
        self.scopes.append(scope)
        self._visit_all(nodes)
        self.scopes.pop()

    def _visit_all(self, nodes: list[Any]) -> None:
        for node in nodes:
            self.visit(node)


_Comprehension = ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp
_Function = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
_NEW_SCOPE = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.ListComp,
              ast.SetComp, ast.GeneratorExp, ast.DictComp)


def _function_scope(node: _Function) -> _Scope:
    """A function's scope: its parameters and the names its body binds (not those it
    declares ``global``), whether or not the statement binding them ever runs."""
    args = node.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    body: list[ast.AST] = [node.body] if isinstance(node, ast.Lambda) else list(node.body)
    bound, declared_global = _bindings(body)
    bound |= {p.arg for p in params if p is not None}
    bound |= {t.name for t in getattr(node, "type_params", ())}  # def f[T]() (3.12)
    return _Scope("function", bound - declared_global, declared_global)


def _bindings(body: list[ast.AST]) -> tuple[set[str], set[str]]:
    """The names a scope's body binds (``nonlocal`` ones too: they are not globals) and
    those it declares ``global``; nested scopes keep theirs, but ``:=`` in a
    comprehension binds here."""
    bound: set[str] = set()
    declared_global: set[str] = set()
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        bound.update(_binds(node))
        if isinstance(node, ast.Global):
            declared_global.update(node.names)
        elif isinstance(node, ast.Nonlocal):
            bound.update(node.names)
        if isinstance(node, _NEW_SCOPE):
            stack += _outer_parts(node)
            if isinstance(node, _Comprehension):
                bound |= _walrus_targets(node)
        else:
            stack += ast.iter_child_nodes(node)
    return bound, declared_global


def _binds(node: ast.AST) -> list[str]:
    """The names one node binds in the scope it stands in."""
    if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
        return [node.id]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"]
    if isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)):
        return [node.name] if node.name else []
    if isinstance(node, ast.MatchMapping):
        return [node.rest] if node.rest else []
    return []


def _walrus_targets(node: _Comprehension) -> set[str]:
    """``:=`` targets in a comprehension (and those nested in it), which bind in the
    scope around it; a lambda's are its own."""
    found: set[str] = set()
    stack: list[ast.AST] = [node]
    while stack:
        part = stack.pop()
        if isinstance(part, ast.NamedExpr) and isinstance(part.target, ast.Name):
            found.add(part.target.id)
        if not isinstance(part, ast.Lambda):
            stack += ast.iter_child_nodes(part)
    return found


def _outer_parts(node: ast.AST) -> list[Any]:
    """The parts of a def, lambda, class or comprehension evaluated where it stands:
    decorators, defaults, annotations, bases, a comprehension's first iterable."""
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
        return [node.generators[0].iter]
    if isinstance(node, ast.ClassDef):
        return [*node.decorator_list, *node.bases, *node.keywords]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return []
    args = node.args
    parts: list[Any] = [*args.defaults, *filter(None, args.kw_defaults)]
    if isinstance(node, ast.Lambda):
        return parts
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    annotations = [p.annotation for p in params if p is not None and p.annotation]
    return [*node.decorator_list, *parts, *annotations, *filter(None, [node.returns])]
