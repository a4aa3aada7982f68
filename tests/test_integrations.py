"""Framework integrations through a real kernel: the recipes of ``docs/frameworks.md``
(a Hugging Face Trainer, Accelerate, a Lightning Trainer, one of the older
``pytorch_lightning`` package, Lightning Fabric, FSDP2, each training a tiny model
built from a config in code, nothing downloaded) run in one notebook with its widget
state kept; what each framework logs arrives in the job's
history and in the panel's stored state, and the progress bar follows its step count.

This test runs that page (``tests/test_docs.py`` leaves it to this one), so the recipes
a reader copies are the ones checked here. The frameworks are test dependencies
(``scripts/test.sh`` installs the ``frameworks`` extra beside the CPU torch); where one
is missing the test skips itself.
"""

from __future__ import annotations

import json
import re

import nbformat
import pytest
from nbclient import NotebookClient

from .test_docs import DOCS, blocks
from .test_panel import panel

pytestmark = pytest.mark.slow

PAGE = DOCS / "frameworks.md"
RECIPES = {  # a word only that recipe's block has
    "hf": "from transformers import",
    "accelerate": "Accelerator(",
    "lightning": "L.Trainer(",
    "pytorch_lightning": "pl.Trainer(",
    "fabric": "L.Fabric(",
    "fsdp2": "fully_shard(model",
}
SHOW_JOB = "import json, nbddp; print(json.dumps(nbddp.last_job().history))"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The page's python blocks in one notebook, each recipe followed by a cell that
    prints its job's history; run with the widget state kept. As on every docs page, a
    ```text block marked <!-- output --> must appear in what the block before printed."""
    for name in ("transformers", "accelerate", "lightning", "pytorch_lightning"):
        pytest.importorskip(name)
    nb = nbformat.v4.new_notebook()
    where: dict[str, int] = {}
    expected: list[tuple[int, str]] = []
    last = -1
    for block in blocks(PAGE):
        if block.is_output:
            expected.append((last, block.body.strip()))
        if block.lang != "python":
            continue
        assert block.raises is None, "a recipe is meant to run"
        nb.cells.append(nbformat.v4.new_code_cell(block.body))
        last = len(nb.cells) - 1
        for name, word in RECIPES.items():
            if word in block.body:
                where[name] = last
                nb.cells.append(nbformat.v4.new_code_cell(SHOW_JOB))
    assert set(where) == set(RECIPES), f"{PAGE.name} lacks a recipe: {where}"
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                   store_widget_state=True,
                   resources={"metadata": {"path": str(tmp_path_factory.mktemp("nb"))}}
                   ).execute()
    for cell in nb.cells:
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert not errors, f"{cell.source[:200]}\n" + "\n".join(errors[0].traceback)
    for index, text in expected:
        printed = "".join(o.get("text", "") for o in nb.cells[index].outputs)
        assert text in printed, f"{PAGE.name}: {text!r} not in what the block printed:\n{printed}"
    nb.metadata["recipe_cells"] = where
    return nb


def ran(nb, name):
    """The index of the recipe's cell, and its job's history."""
    index = nb.metadata["recipe_cells"][name]
    shown = "".join(o.get("text", "") for o in nb.cells[index + 1].outputs)
    return index, json.loads(shown)


def panel_state(nb, index):
    """The stored progress bar and the panel's HTML (header, metrics table, charts)."""
    models = panel(nb, index)
    (bar,) = models["IntProgressModel"]
    return bar, " ".join(m["value"] for m in models["HTMLModel"])


def step_time_line(nb, index):
    """The panel's split of each rank's step time, as the saved notebook reads it."""
    (shown,) = [o for o in nb.cells[index].outputs if o.output_type == "display_data"
                and "application/vnd.jupyter.widget-view+json" in o.data]
    return next((line for line in shown.data["text/plain"].splitlines()
                 if line.startswith("time per step: ")), "")


MEASURED = re.compile(r"time per step: rank 0: data \d+% compute \d+% collectives \d+% "
                      r"\(.+/step\); rank 1: data \d+% compute \d+% collectives \d+%")


def test_a_hugging_face_trainer_logs_loss_learning_rate_and_eval_at_its_steps(executed):
    index, history = ran(executed, "hf")
    training = [row for row in history if "loss" in row]
    assert [row["step"] for row in training] == list(range(2, 11, 2)), history  # logging_steps
    # The Trainer's values are already reduced over the ranks: rank 0's, shown at once.
    assert all({"learning_rate", "grad_norm"} <= set(row) for row in training)
    assert all(row["ranks"] == 1 and "epoch" not in row for row in history)  # no bookkeeping
    assert [row["step"] for row in history if "eval_loss" in row] == [5, 10]
    assert not any("eval_runtime" in row for row in history)
    bar, html = panel_state(executed, index)
    assert (bar["value"], bar["max"]) == (10, 10)  # max_steps
    assert "eval_loss" in html and "learning_rate" in html
    # The Trainer's steps are timed, and its DDP model's all-reduce measured:
    assert MEASURED.match(step_time_line(executed, index)), step_time_line(executed, index)


def test_accelerate_logs_from_its_main_process_and_is_shown_at_once(executed):
    index, history = ran(executed, "accelerate")
    assert [row["step"] for row in history] == list(range(8))  # 256 / 16 / 2 ranks
    # Accelerate logs on its main process only: rank 0's values, not waited for.
    assert all(row["ranks"] == 1 for row in history)
    bar, html = panel_state(executed, index)
    assert (bar["value"], bar["max"]) == (8, 8)
    assert "<b>loss</b>" in html


def test_a_pytorch_lightning_trainer_reports_by_itself_too(executed):
    """The older package's Trainer, through its own entry point: its metrics per step,
    averaged over both ranks, and its steps on the bar."""
    index, history = ran(executed, "pytorch_lightning")
    assert [row["step"] for row in history] == list(range(1, 5)), history  # 128 / 16 / 2
    assert all(set(row) == {"step", "ranks", "train_loss"} for row in history), history
    assert all(row["ranks"] == 2 for row in history), history
    bar, html = panel_state(executed, index)
    assert (bar["value"], bar["max"]) == (4, 4)
    assert "train_loss" in html and "epoch 0" in html


def test_a_lightning_trainer_reports_by_itself_per_step_and_per_epoch(executed):
    index, history = ran(executed, "lightning")
    names = set().union(*history)
    assert {"train_loss_step", "train_loss_epoch", "val_loss"} <= names, names
    assert "train_loss" not in names  # Lightning's unsuffixed copy is left out
    per_step = [row["step"] for row in history if "train_loss_step" in row]
    assert per_step == list(range(1, 15)), history  # 224 / 16 / 2 ranks = 7, 2 epochs
    assert all(row["ranks"] == 2 for row in history), [r for r in history if r["ranks"] != 2]
    bar, html = panel_state(executed, index)
    assert (bar["value"], bar["max"]) == (14, 14)
    assert "epoch 1" in html and "val_loss" in html
    assert MEASURED.match(step_time_line(executed, index)), step_time_line(executed, index)


def test_lightning_fabric_logs_through_its_logger_averaged_over_ranks(executed):
    index, history = ran(executed, "fabric")
    assert [row["step"] for row in history] == list(range(8))
    assert all(row["ranks"] == 2 and "loss" in row for row in history)
    bar, _ = panel_state(executed, index)
    assert (bar["value"], bar["max"]) == (8, 8)


def test_an_fsdp2_model_trains_sharded_and_comes_back_whole(executed):
    # The page's own output checks: FSDPNet with DTensor weights on the ranks, the
    # user's Net with plain CPU parameters in the notebook.
    index, history = ran(executed, "fsdp2")
    assert [row["step"] for row in history] == list(range(20))
    assert all(row["ranks"] == 2 for row in history)
    assert history[-1]["loss"] < history[0]["loss"]
    bar, _ = panel_state(executed, index)
    assert (bar["value"], bar["max"]) == (20, 20)
