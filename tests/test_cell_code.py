"""A ``%%ddp`` cell as a rank runs it: its code is compiled once per source, and its
report is pickled plainly when nothing in it needs cloudpickle. Pure logic, in this
process (the kernel tests run the same cells on real ranks)."""

from __future__ import annotations

import linecache
import pickle
import traceback

import pytest
import torch

from nbddp._rank.cell import Cell, CellResult, _compiled
from nbddp._rank.scope import Scope
from nbddp._wire import dataplane

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


def _run(cell: Cell, scope: Scope) -> CellResult:
    with scope.tracking():
        return cell.run_in(scope)


def test_a_rerun_cell_runs_as_written_each_time_with_its_code_compiled_once():
    scope, name = Scope(), "/tmp/ipykernel_0/cell-rerun.py"
    cell = Cell("\nn = n + 1 if 'n' in dir() else 1\nn * 10\n", name)
    _compiled.cache_clear()
    assert [_run(cell, scope).value for _ in range(3)] == [10, 20, 30]
    assert _compiled.cache_info().misses == 1 and _compiled.cache_info().hits == 2
    edited = Cell("\nn = -1\nn\n", name)  # the same name, other code: the new code runs
    assert _run(edited, scope).value == -1 and scope.globals["n"] == -1


def test_a_cell_without_a_trailing_expression_has_no_value():
    scope = Scope()
    assert _run(Cell("x = 1\nfor i in range(3):\n    x += i\n", "cell-loop"), scope).value \
        is None
    assert scope.globals["x"] == 4


def test_a_cached_cell_s_traceback_shows_its_lines():
    name = "/tmp/ipykernel_0/cell-fails.py"
    cell = Cell("\nx = 1\nraise ValueError('from the cell')\n", name)
    for _ in range(2):  # (the second run from the cache)
        linecache.cache.pop(name, None)  # (a rank that ran other cells meanwhile)
        with pytest.raises(ValueError) as caught:
            _run(cell, Scope())
        shown = "".join(traceback.format_tb(caught.value.__traceback__))
        assert "raise ValueError('from the cell')" in shown and f'"{name}", line 3' in shown


def test_a_syntax_error_is_raised_every_time():
    cell = Cell("\nx = (\n", "cell-broken")
    for _ in range(2):
        with pytest.raises(SyntaxError):
            _run(cell, Scope())


def test_a_quick_cell_s_report_is_a_plain_pickle_and_others_are_cloudpickle_s():
    quick = CellResult(None, {})
    packed = dataplane.pack(quick, to_cpu=True)
    assert packed.data == pickle.dumps(quick, protocol=5) and not packed.buffers
    assert dataplane.Packed(packed.data).load() == quick
    for value in (CellResult(3.5, {}), CellResult(True, {})):
        assert dataplane.pack(value).data == pickle.dumps(value, protocol=5)
    tensor = torch.arange(100_000, dtype=torch.float32)
    for value in (CellResult(tensor, {}), CellResult(None, {"t": tensor}),
                  CellResult("text", {}), CellResult(lambda: 1, {})):
        packed = dataplane.pack(value, to_cpu=True)
        assert packed.data != pickle.dumps(CellResult(None, {}), protocol=5)
        back = packed.load()
        assert type(back) is CellResult
    assert dataplane.pack(CellResult(tensor, {}), to_cpu=True).buffers  # (out of band)
    assert dataplane.pack(CellResult(lambda: 1, {})).load().value() == 1  # by value
