"""A session's notebook functions: whole until every rank holds them, then by number.

The kernel's and the ranks' sides meet in one process here: pickling as the kernel
does for a session's ranks, unpickling as a rank does, with the rank's store of held
functions swapped for a fresh one where a test needs a rank that was never taught.
Sessions on real ranks call held functions in ``test_session.py``.
"""

from __future__ import annotations

import textwrap
import threading
import types

import cloudpickle
import pytest

from nbddp._wire import held_functions
from nbddp._wire.dataplane import Packed
from nbddp._wire.held_functions import RanksFunctions
from nbddp._wire.payload import Payload

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


@pytest.fixture(autouse=True)
def fresh_rank(monkeypatch):
    """This process's rank side starts holding nothing."""
    monkeypatch.setattr(held_functions, "_HELD", {})


def notebook(source: str) -> dict:
    """The globals of a notebook that ran ``source`` (its functions pickle by value)."""
    names: dict = {"__name__": "__main__"}
    exec(compile(textwrap.dedent(source), "<ipython-input-3-0123>", "exec"), names)  # noqa: S102
    return names


def sent(fn, *args, functions: RanksFunctions | None) -> Packed:
    return Payload.capture(fn, args, {}).dumps(functions=functions)


def called_on_a_rank(packed: Packed):
    """What a rank gets from ``packed``, called."""
    payload = Payload.unpack(Packed(packed.data, packed.buffers))
    return payload.fn(*payload.args, **payload.kwargs)


def taught(functions: RanksFunctions, packed: Packed):
    """The rank takes ``packed``, its run returns, and the kernel counts it taught."""
    value = called_on_a_rank(packed)
    functions.taught(packed.teaches)
    return value


NOTEBOOK = """
    offset = 1

    def shifted(x, by=0):
        return x + offset + by

    def factorial(n):
        return 1 if n <= 1 else n * factorial(n - 1)

    def scaler(k):
        def scale(x):
            return x * k
        return scale

    def outer(x):
        return shifted(x) * 2

    def keyword(x, *, by=1):
        return x * by

    def late():
        def inner():
            return later
        later = 5
        return inner
"""


def test_a_function_goes_whole_until_taught_then_by_number():
    nb, functions = notebook(NOTEBOOK), RanksFunctions()
    first = sent(nb["shifted"], 1, functions=functions)
    assert first.teaches  # whole, teaching
    again = sent(nb["shifted"], 1, functions=functions)
    assert again.teaches == first.teaches  # not yet counted as held: whole again
    assert taught(functions, first) == 2
    held = sent(nb["shifted"], 1, functions=functions)
    assert not held.teaches
    assert len(held.data) < len(first.data) - 200  # no code, no names
    assert called_on_a_rank(held) == 2


def test_a_held_function_brings_what_changed_in_the_notebook_with_each_call():
    nb, functions = notebook(NOTEBOOK), RanksFunctions()
    taught(functions, sent(nb["shifted"], 1, functions=functions))
    taught(functions, sent(nb["scaler"](2), 1, functions=functions))
    nb["offset"] = 10
    assert called_on_a_rank(sent(nb["shifted"], 1, functions=functions)) == 11
    nb["shifted"].__defaults__ = (100,)
    assert called_on_a_rank(sent(nb["shifted"], 1, functions=functions)) == 111
    nb["shifted"].note = "an attribute"
    nb["shifted"].__annotations__ = {"x": int}
    packed = sent(nb["shifted"], 1, functions=functions)
    shifted = Payload.unpack(Packed(packed.data, packed.buffers)).fn
    assert (shifted.note, shifted.__annotations__) == ("an attribute", {"x": int})
    tripled = nb["scaler"](3)  # the same code, another closure
    packed = sent(tripled, 5, functions=functions)
    assert not packed.teaches and called_on_a_rank(packed) == 15


def test_a_function_redefined_or_renamed_goes_whole_again():
    nb, functions = notebook(NOTEBOOK), RanksFunctions()
    first = sent(nb["shifted"], 1, functions=functions)
    taught(functions, first)
    nb.update(notebook("def shifted(x, by=0):\n    return x - 1\n"))
    redefined = sent(nb["shifted"], 1, functions=functions)
    assert redefined.teaches and redefined.teaches != first.teaches
    assert called_on_a_rank(redefined) == 0
    taught(functions, redefined)
    nb["shifted"].__doc__ = "documented since"
    documented = sent(nb["shifted"], 1, functions=functions)
    assert documented.teaches  # a held function keeps its doc: this one goes whole
    payload = Payload.unpack(Packed(documented.data, documented.buffers))
    assert payload.fn.__doc__ == "documented since"


def test_recursive_and_calling_functions_share_their_globals_on_the_rank():
    nb, functions = notebook(NOTEBOOK), RanksFunctions()
    for fn in (nb["factorial"], nb["outer"]):
        taught(functions, sent(fn, 5, functions=functions))
    assert called_on_a_rank(sent(nb["factorial"], 5, functions=functions)) == 120
    packed = sent(nb["outer"], 5, functions=functions)
    assert not packed.teaches  # outer and the shifted it calls: both by number
    outer = Payload.unpack(Packed(packed.data, packed.buffers)).fn
    assert outer.__globals__["shifted"].__globals__ is outer.__globals__  # as cloudpickle's
    assert outer(5) == 12


def test_a_held_function_reads_the_globals_cloudpickle_would_send():
    nb = notebook(NOTEBOOK)
    nb["unused"] = threading.Lock()  # a notebook name no function reads: never pickled
    functions = RanksFunctions()
    taught(functions, sent(nb["outer"], 1, functions=functions))
    packed = sent(nb["outer"], 1, functions=functions)
    outer = Payload.unpack(Packed(packed.data, packed.buffers)).fn
    whole = cloudpickle.loads(cloudpickle.dumps(nb["outer"]))
    mine = {k for k in outer.__globals__ if not k.startswith("__")}
    assert mine == {k for k in whole.__globals__ if not k.startswith("__")}
    assert mine == {"shifted", "offset"}  # (outer's, and the shifted it calls, share them)


def test_a_rank_that_was_never_taught_a_number_says_so(monkeypatch):
    nb, functions = notebook(NOTEBOOK), RanksFunctions()
    taught(functions, sent(nb["shifted"], 1, functions=functions))
    held = sent(nb["shifted"], 1, functions=functions)
    monkeypatch.setattr(held_functions, "_HELD", {})  # a rank the kernel did not teach
    with pytest.raises(RuntimeError, match=r"does not hold notebook function #1.*defect"):
        called_on_a_rank(held)


def test_without_the_ranks_functions_a_function_goes_as_cloudpickle_sends_it():
    nb = notebook(NOTEBOOK)
    packed = sent(nb["shifted"], 1, functions=None)
    assert packed.functions is None and not packed.teaches
    assert called_on_a_rank(packed) == 2
    assert not held_functions._HELD  # nothing learned


def test_functions_of_modules_go_by_name_and_teach_nothing():
    functions = RanksFunctions()
    packed = sent(textwrap.dedent, " x", functions=functions)
    assert not packed.teaches and called_on_a_rank(packed) == "x"
    assert isinstance(textwrap.dedent, types.FunctionType)


def test_keyword_defaults_and_closure_cells_empty_or_filled_arrive_by_number():
    nb, functions = notebook(NOTEBOOK), RanksFunctions()
    taught(functions, sent(nb["keyword"], 2, functions=functions))
    nb["keyword"].__kwdefaults__ = {"by": 7}
    packed = sent(nb["keyword"], 2, functions=functions)
    assert not packed.teaches and called_on_a_rank(packed) == 14
    inner = nb["late"]()  # its cell for ``later`` holds 5
    taught(functions, sent(inner, functions=functions))
    empty = types.FunctionType(inner.__code__, inner.__globals__, "inner", None,
                               (types.CellType(),))  # the same code, ``later`` not bound yet
    empty.__qualname__ = inner.__qualname__
    packed = sent(empty, functions=functions)
    assert not packed.teaches
    with pytest.raises(NameError, match="later"):
        called_on_a_rank(packed)
    assert called_on_a_rank(sent(inner, functions=functions)) == 5


def test_functions_a_decorator_makes_share_its_code_and_each_is_held():
    nb = notebook("""
        import functools

        def logged(fn):
            @functools.wraps(fn)
            def wrapper(*args):
                return fn(*args)
            return wrapper

        @logged
        def double(x):
            return 2 * x

        @logged
        def square(x):
            return x * x

        def both(x):
            return double(x), square(x)
    """)
    functions = RanksFunctions()
    assert nb["double"].__code__ is nb["square"].__code__  # the wrapper's
    first = sent(nb["both"], 3, functions=functions)
    assert taught(functions, first) == (6, 9)
    held = sent(nb["both"], 3, functions=functions)
    assert not held.teaches  # both wrappers by number, each under its own
    assert called_on_a_rank(held) == (6, 9)
    assert len(held_functions._HELD) == len(first.teaches) == 5


def test_a_submodule_the_kernel_imported_since_is_imported_on_the_rank_too():
    nb = notebook("""
        import email

        def parse(text, now):
            return email.parser.Parser().parsestr(text)["to"] if now else None
    """)
    functions = RanksFunctions()
    taught(functions, sent(nb["parse"], "to: ranks", False, functions=functions))
    exec("import email.parser", nb)  # noqa: S102 - (``import email`` alone does not)
    packed = sent(nb["parse"], "to: ranks", True, functions=functions)
    assert not packed.teaches
    assert b"email.parser" in packed.data  # imported as the rank unpickles the call
    assert called_on_a_rank(packed) == "ranks"


def test_the_submodules_sent_with_a_call_are_those_cloudpickle_finds():
    import concurrent.futures  # noqa: F401 - (imported: found)
    import xml.dom.minidom  # noqa: F401

    import torch.nn.functional

    nb = notebook("""
        import concurrent, torch, xml
        import torch.nn.functional as F

        def uses(x):
            return (torch.nn.functional.relu, F.relu, concurrent.futures.Future,
                    torch.distributed, xml.dom.minidom.parseString, torch.cuda.amp)
    """)
    code = nb["uses"].__code__
    for values in ([nb["torch"]], [nb["torch"], nb["F"], nb["concurrent"]], [nb["xml"]],
                   [textwrap]):
        theirs = cloudpickle.cloudpickle._find_imported_submodules(code, values)
        mine = held_functions.imported_submodules(code, values)
        assert {m.__name__ for m in mine} == {m.__name__ for m in theirs}
    assert torch.nn.functional in held_functions.imported_submodules(code, [nb["torch"]])


def test_a_submodule_imported_after_the_first_calls_by_number_goes_with_the_next(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "json.tool", raising=False)  # (not imported yet)
    nb = notebook("""
        import json

        def tool(now):
            return json.tool.main if now else None
    """)
    functions = RanksFunctions()
    taught(functions, sent(nb["tool"], False, functions=functions))
    assert b"json.tool" not in sent(nb["tool"], False, functions=functions).data
    exec("import json.tool", nb)  # noqa: S102 - the notebook imports it now
    packed = sent(nb["tool"], True, functions=functions)
    assert not packed.teaches and b"json.tool" in packed.data
    assert called_on_a_rank(packed) is sys.modules["json.tool"].main
