"""A notebook cell as something every rank can run.

The cell travels as its source and the notebook names it reads before assigning them:
imported modules go by name, notebook functions, classes and data by value, and names
it does not use stay in the kernel. On a rank it runs like a notebook cell: statements
in order, a trailing expression's value returned, line numbers the cell's own.
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

from .scope import Scope


@dataclass(frozen=True)
class CellResult:
    """A rank's view after the cell ran: its trailing expression and the ``--out`` names
    (which rank 0 sends back, made whole: see ``_rank.whole``)."""

    value: Any = None
    outputs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Cell:
    """A cell's code with the notebook names it needs; calling it runs the cell."""

    source: str
    """The code, compiled as is; its line numbers are the ones the user sees."""
    filename: str
    """The name tracebacks show for the cell (IPython's name for it in a notebook)."""
    namespace: dict[str, Any] = field(default_factory=dict)
    """The notebook names the cell reads."""
    outputs: tuple[str, ...] = ()
    """Names whose values come back to the notebook after the run."""

    @classmethod
    def from_notebook(
        cls, source: str, filename: str, user_ns: Mapping[str, Any],
        hidden: Mapping[str, Any] | None = None, outputs: tuple[str, ...] = (),
        ranks_own: Collection[str] = (),
    ) -> Cell:
        """Parse ``source`` (a SyntaxError points at the cell's line) and pick its names:
        those it reads, except IPython's own and ``ranks_own`` (a session's names)."""
        __tracebackhide__ = True
        from .._wire.cell_names import names_read_in  # the kernel's work, not a rank's

        hidden = hidden or {}
        names = [n for n in names_read_in(source, filename)
                 if n in user_ns and n not in ranks_own
                 and not (n in hidden and hidden[n] is user_ns[n])]
        return cls(source, filename, {n: user_ns[n] for n in names}, outputs)

    def __nbddp_captured__(self) -> Iterator[tuple[str, Any]]:
        """What a user would recognise as shipped, for pickling errors and size warnings."""
        for name, value in self.namespace.items():
            yield f"notebook name {name!r}", value

    def __nbddp_imports__(self) -> set[str]:
        """The top-level modules the cell's ``import`` lines name: of the user's own,
        those ship with it to nodes that cannot see them (``_wire.shipped_code``)."""
        from .._wire.users_code import imported_names  # the kernel's work, not a rank's

        return imported_names(self.source)

    def __call__(self) -> CellResult:
        return self.run_in(Scope())

    def run_in(self, scope: Scope) -> CellResult:
        """Run the cell in ``scope`` (with the notebook names it brought); rank 0's view."""
        scope.take(self.namespace)
        namespace = scope.globals
        lines = self.source.splitlines(keepends=True)  # a traceback shows the cell's lines
        linecache.cache[self.filename] = (len(self.source), None, lines, self.filename)
        body, last = _compiled(self.source, self.filename)
        value = None
        try:
            exec(_fresh(body), namespace)
            if last is not None:
                value = eval(_fresh(last), namespace)
        except SystemExit as exc:  # sys.exit() / exit() ends the cell, like a script
            if exc.code not in (None, 0):
                raise
        outputs = {name: namespace[name] for name in self.outputs if name in namespace}
        if int(os.environ.get("RANK", "0")) != 0:
            return CellResult(value, outputs)  # dropped once it helped gather rank 0's
        missing = [name for name in self.outputs if name not in namespace]
        if missing:
            raise NameError(f"--out names not defined by the cell: {', '.join(missing)}")
        return CellResult(value, outputs)


@functools.lru_cache(maxsize=128)
def _compiled(source: str, filename: str) -> tuple[CodeType, CodeType | None]:
    """A cell's code less a trailing expression, and that expression's code (like
    IPython, the cell's value), or None. Kept per source and name: a session reruns its
    cells, and parsing and compiling took half of a small cell's run on a rank (IPython
    names a cell by its source's hash, so an edited cell is another entry). A SyntaxError
    is raised again each time; a warning the compiler gives, the first time only."""
    tree = ast.parse(source, filename)
    last = tree.body[-1] if tree.body else None
    if not isinstance(last, ast.Expr):
        return compile(tree, filename, "exec"), None
    tree.body.pop()
    return compile(tree, filename, "exec"), compile(ast.Expression(last.value), filename, "eval")


def _fresh(code: CodeType) -> CodeType:
    """A copy of ``code`` and of the code nested in it (functions, classes, lambdas): each
    run of a cell defines its functions with code objects of their own, as a freshly
    compiled cell would (``torch.compile`` keeps its graphs and counts recompiles per
    code object: a rerun cell's model must not inherit the last run's)."""
    return code.replace(co_consts=tuple(_fresh(const) if isinstance(const, CodeType) else const
                                        for const in code.co_consts))
