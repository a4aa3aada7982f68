"""A ``%%ddp`` cell as a rank runs it: its code is compiled once per source, and the cell
and its report are pickled plainly when nothing in them needs cloudpickle. Pure logic, in
this process (the kernel tests run the same cells on real ranks)."""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import traceback

import pytest
import torch

from nbddp._rank.cell import Cell, CellResult, _compiled
from nbddp._rank.scope import Scope
from nbddp._wire import dataplane, payload
from nbddp._wire.payload import Payload

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


def test_a_cell_s_report_comes_back_as_it_was():
    plain = [CellResult(None, {}), CellResult(3.5, {}), CellResult(True, {}), CellResult(7),
             CellResult("text", {}), CellResult((1, "a", None), {}),
             CellResult({"loss": 0.5, "steps": (1, 2)}), CellResult(tuple(range(20)))]
    tensor = torch.arange(100_000, dtype=torch.float32)
    other = [CellResult(tensor, {}), CellResult(None, {"t": tensor}), CellResult([1, 2], {}),
             CellResult(lambda: 1, {}), CellResult(None, {"n": 1}), CellResult({1: 2}),
             CellResult(tuple(range(40))), CellResult(b"bytes"), CellResult((1, tensor))]
    for value in plain:
        packed = dataplane.pack(value, to_cpu=True)
        assert not packed.buffers and dataplane.Packed(packed.data).load() == value
    for value in other:
        assert type(dataplane.pack(value, to_cpu=True).load()) is CellResult
    assert dataplane.pack(CellResult(tensor, {}), to_cpu=True).buffers  # (out of band)
    assert dataplane.pack(CellResult(lambda: 1, {})).load().value() == 1  # by value


def test_each_run_of_a_cell_defines_its_functions_with_code_of_their_own():
    """As a freshly compiled cell's would: ``torch.compile`` keeps its graphs and counts
    its recompiles per code object, so a rerun cell's function must not share them."""
    scope, seen = Scope(), []
    cell = Cell("\ndef step(x):\n    return [i for i in x]\nclass Model:\n"
                "    def forward(self):\n        return 1\n(step, Model)\n", "cell-defines")
    for _ in range(2):
        step, model = _run(cell, scope).value
        seen.append((step.__code__, model.forward.__code__))
        assert step([1, 2]) == [1, 2] and model().forward() == 1
    (first_step, first_forward), (second_step, second_forward) = seen
    assert first_step is not second_step and first_forward is not second_forward
    assert _compiled.cache_info().currsize >= 1  # (compiled once all the same)


def test_a_cell_and_its_notebook_names_reach_a_rank_as_they_were():
    plain = [Cell("\nNone\n", "cell-quick"),
             Cell("\nx = n * 2\nx\n", "cell-names", {"n": 21, "tag": "run"}, ("x",))]
    other = [Cell("\nf()\n", "cell-f", {"f": lambda: 1}),
             Cell("\nos.sep\n", "cell-module", {"os": os}),
             Cell("\nt.sum()\n", "cell-tensor", {"t": torch.ones(3)})]
    for cell in plain:
        packed = Payload.capture(cell, (), {}).dumps()
        assert not packed.buffers
        unpacked = Payload.unpack(packed)
        assert unpacked.fn == cell and (unpacked.args, unpacked.kwargs) == ((), {})
    assert _run(Payload.unpack(Payload.capture(plain[1], (), {}).dumps()).fn, Scope()) == \
        CellResult(42, {"x": 42})
    for cell in other:  # (by value, as before: cloudpickle)
        assert Payload.unpack(Payload.capture(cell, (), {}).dumps()).fn.source == cell.source


def _self_referring() -> dict:
    loop: dict = {"n": 1}
    loop["me"] = loop
    return loop


def test_a_self_referring_notebook_name_reaches_a_rank_whole():
    cell = Cell("\nloop['n']\n", "cell-loop", {"loop": _self_referring()})
    sent = Payload.unpack(Payload.capture(cell, (), {}).dumps()).fn
    assert sent.namespace["loop"]["me"] is sent.namespace["loop"]
    assert _run(sent, Scope()).value == 1


class _CountedSends:
    """A ``Kept`` that counts its sends (a session's copies of the kernel's tensors)."""

    def __init__(self) -> None:
        self.sends = 0

    @contextlib.contextmanager
    def sending(self):
        self.sends += 1
        yield


def test_a_payload_packed_with_kept_copies_lets_them_see_the_send():
    """As a session packs a cell: its kept copies see the send (they sweep what is
    outdated), though the cell holds no tensor."""
    kept = _CountedSends()
    packed = dataplane.pack((Cell("\nNone\n", "cell-quick"), (), {}), kept=kept)
    assert kept.sends == 1 and not packed.buffers


def test_the_import_path_asks_for_the_working_directory_only_if_it_holds_a_relative_one(
        monkeypatch, tmp_path):
    """A session sends the kernel's import path with every run; asking for the working
    directory each time would let the kernel's other threads take the GIL each time."""
    absolute = [str(tmp_path / "lib"), "", os.path.dirname(os.__file__)]
    monkeypatch.setattr(sys, "path", absolute)
    monkeypatch.setattr(payload, "_import_path_seen", None)
    assert payload._import_path() == (absolute[0], absolute[2])
    with monkeypatch.context() as patched:
        patched.setattr(os, "getcwd", None)  # (called: TypeError)
        assert payload._import_path() == (absolute[0], absolute[2])
    monkeypatch.setattr(sys, "path", [*absolute, "src"])
    for folder in (tmp_path, tmp_path / "lib"):
        folder.mkdir(exist_ok=True)
        monkeypatch.chdir(folder)
        assert payload._import_path()[-1] == str(folder / "src")
