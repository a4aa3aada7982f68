"""Which notebook names code reads: a cell by Python's scoping rules, a function by the
global-name instructions of its compiled code. What these find is what ships to the
ranks (a name missed fails there with NameError; a name wrongly found ships a notebook
value the code never reads, and fails the launch if it cannot be pickled)."""

from __future__ import annotations

import ast
import textwrap

import pytest

from nbddp._wire.cell_names import names_read_from_outside
from nbddp._wire.payload import global_names

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


def reads(source: str) -> set[str]:
    return names_read_from_outside(ast.parse(textwrap.dedent(source)))


@pytest.mark.parametrize("source, expected", [
    ("total += 1", {"total"}),
    ("for i in range(3):\n    total += i", {"range", "total"}),
    ("model.steps += 1", {"model"}),
    ("steps[0] += 1", {"steps"}),
    ("x = x + 1", {"x"}),
    ("del x", {"x"}),
    ("y = 1\nprint(y)", {"print"}),
])
def test_a_name_counts_when_read_before_the_cell_binds_it(source, expected):
    assert reads(source) == expected


@pytest.mark.parametrize("source, expected", [
    ("[z for z in xs]", {"xs"}),
    ("[z * scale for z in xs if z]", {"scale", "xs"}),
    ("[[a * b for b in row] for a, row in pairs]", {"pairs"}),
    ("sum(w for w in ws)", {"sum", "ws"}),
    ("{s for s in ss}", {"ss"}),
    ("{k: v for k, v in items}", {"items"}),
    ("[z for z in range(3)]\nz", {"range", "z"}),  # the loop variable does not leak
    ("[z for z in z]", {"z"}),  # the first iterable is read outside
    ("fs = [lambda: z for z in xs]", {"xs"}),  # the lambda closes over the loop's z
    ("[last := x for x in xs]\nprint(last)", {"print", "xs"}),  # := binds in the cell
])
def test_comprehension_variables_are_the_comprehensions_own(source, expected):
    assert reads(source) == expected


@pytest.mark.parametrize("source, expected", [
    ("f = lambda q, *rest, k=default: q + offset", {"default", "offset"}),
    ("""
     def f(a):
         b = a + k
         return b
     """, {"k"}),
    ("""
     def f():
         return later  # a function runs later: the cell binds ``later`` first
     later = 1
     f()
     """, set()),
    ("""
     def f():
         print(x)  # x is f's local (UnboundLocalError in Python too), not the notebook's
         x = 1
     """, {"print"}),
    ("""
     def bump():
         global total
         total += 1
     bump()
     """, {"total"}),
    ("""
     def outer():
         n = 0
         def inner():
             nonlocal n
             n += 1
         inner()
     """, set()),
    ("""
     @deco(level)
     def f(a: Tensor = default) -> Out:
         pass
     """, {"deco", "level", "Tensor", "default", "Out"}),
    ("""
     class C(Base):
         size = base * 2
         twice = size * 2
         sq = [i * size for i in range(4)]  # a comprehension does not see the class's
         def m(self):
             return size  # nor does a method: this is the global ``size``
     """, {"Base", "base", "range", "size"}),
    ("""
     class C:
         pass
     C()
     """, set()),
])
def test_functions_lambdas_and_classes_scope_as_python_does(source, expected):
    assert reads(source) == expected


@pytest.mark.parametrize("source, expected", [
    ("import os.path\nos.getcwd()", set()),
    ("from math import pi as p\np", set()),
    ("try:\n    pass\nexcept ValueError as e:\n    print(e)", {"ValueError", "print"}),
    ("with open(f) as handle:\n    handle.read()", {"open", "f"}),
    ("for z in xs:\n    print(z)", {"print", "xs"}),
    ("""
     match point:
         case Point(x=a, y=0):
             print(a)
         case {"k": b, **rest}:
             print(b, rest)
         case [first, *others]:
             print(first, others)
     """, {"point", "Point", "print"}),
])
def test_other_bindings(source, expected):
    assert reads(source) == expected


# --- a function's globals, from its bytecode ------------------------------------------


def calls_a_method():
    model = make_model()  # noqa: F821
    model.train()


def imports_a_module():
    import os.path
    return os.path.join("a", "b")


def nests_code():
    def inner():
        return helper()  # noqa: F821

    later = lambda: other  # noqa: E731, F821

    class Local:
        attr = const  # noqa: F821 (a class body reads globals by LOAD_NAME)

    return inner, later, Local, [w * scale for w in items]  # noqa: F821


def writes_a_global():
    global counter
    counter = 1


@pytest.mark.parametrize("fn, expected", [
    (calls_a_method, {"make_model"}),
    (imports_a_module, set()),
    (nests_code, {"helper", "other", "const", "scale", "items"}),
    (writes_a_global, {"counter"}),
])
def test_global_names_are_the_ones_the_code_loads_or_stores_as_globals(fn, expected):
    """Attribute and module names share ``co_names`` with globals; they are no globals."""
    assert global_names(fn.__code__) == expected
