"""Framework integrations through a real kernel: a Hugging Face Trainer, a Lightning
Trainer, Lightning Fabric and Accelerate each train a tiny model (built from a config in
code, nothing downloaded) in ``nbddp.launch(..., init=False)``; what they log arrives in
the job's history and in the panel's stored widget state, and the progress bar follows
their step count.

The frameworks are test dependencies (``scripts/test.sh`` installs the ``frameworks``
extra beside the CPU torch); where one is missing its test skips itself.
"""

from __future__ import annotations

import json

import nbformat
import pytest
from nbclient import NotebookClient

from .test_panel import WIDGET_STATE

pytestmark = pytest.mark.slow

SETUP = '''
import json
import nbddp

def run(fn):
    job = nbddp.launch(fn, nprocs=2, init=False, wait=False, timeout=240)
    value = job.result()
    return json.dumps({"value": value, "history": job.history})
'''

HF = '''
def hf_trainer():
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
    from nbddp.integrations.transformers import NbddpCallback

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=16)

    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"input_ids": torch.randint(0, 50, (8,), generator=g), "labels": i % 2}

    args = TrainingArguments(output_dir="hf-out", max_steps=8, per_device_train_batch_size=4,
                             logging_steps=2, eval_strategy="steps", eval_steps=4,
                             report_to="none", use_cpu=True, save_strategy="no")
    trainer = Trainer(model=BertForSequenceClassification(config), args=args,
                      train_dataset=Pairs(), eval_dataset=Pairs(), callbacks=[NbddpCallback()])
    trainer.train()
    return trainer.state.global_step

run(hf_trainer)
'''

LIGHTNING = '''
def lightning_trainer():
    import lightning as L
    import torch

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch, _):
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # no nbddp callback given: it comes by itself
    trainer.fit(Net(), loader, loader)
    return [type(callback).__name__ for callback in trainer.callbacks]

run(lightning_trainer)
'''

FABRIC = '''
def lightning_fabric():
    import lightning as L
    import torch
    from nbddp.integrations.lightning import NbddpLogger

    fabric = L.Fabric(accelerator="cpu", devices=2, loggers=[NbddpLogger()])
    fabric.launch()
    model = torch.nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in nbddp.progress(range(6), desc="fabric"):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.log_dict({"loss": loss, "rank": float(fabric.global_rank)}, step=step)
    return fabric.world_size

run(lightning_fabric)
'''

ACCELERATE = '''
def accelerate_loop():
    import torch
    from accelerate import Accelerator
    from nbddp.integrations.accelerate import NbddpTracker

    accelerator = Accelerator(log_with=NbddpTracker(), cpu=True)
    accelerator.init_trackers("tiny")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, (x, y) in enumerate(nbddp.progress(loader, desc="accelerate")):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item(), "rank": float(accelerator.process_index)},
                        step=step)
    accelerator.end_training()
    return step + 1

run(accelerate_loop)
'''

CELLS = {"hf": HF, "lightning": LIGHTNING, "fabric": FABRIC, "accelerate": ACCELERATE}


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """One notebook, one cell per framework, run with the widget state kept."""
    for name in ("transformers", "accelerate", "lightning"):
        pytest.importorskip(name)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(SETUP)]
    nb.cells += [nbformat.v4.new_code_cell(code) for code in CELLS.values()]
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                   store_widget_state=True,
                   resources={"metadata": {"path": str(tmp_path_factory.mktemp("nb"))}}
                   ).execute()
    return nb


def ran(nb, name):
    """The framework cell's value and history, as its last expression returned them."""
    cell = nb.cells[1 + list(CELLS).index(name)]
    errors = [o for o in cell.outputs if o.output_type == "error"]
    assert not errors, "\n".join(errors[0].traceback)
    (result,) = [o for o in cell.outputs if o.output_type == "execute_result"]
    return cell, json.loads(result.data["text/plain"].strip("'"))


def panel_state(nb, cell):
    """The stored progress bar and the panel's HTML (header, metrics table, charts)."""
    state = nb.metadata["widgets"][WIDGET_STATE]["state"]
    (shown,) = [o for o in cell.outputs if o.output_type == "display_data"]
    models: dict[str, list[dict]] = {}

    def walk(model_id):
        model = state[model_id]
        models.setdefault(model["model_name"], []).append(model["state"])
        for child in model["state"].get("children", []):
            walk(child.removeprefix("IPY_MODEL_"))

    walk(shown.data["application/vnd.jupyter.widget-view+json"]["model_id"])
    (bar,) = models["IntProgressModel"]
    return bar, " ".join(m["value"] for m in models["HTMLModel"])


def test_a_hugging_face_trainer_logs_loss_learning_rate_and_eval_at_its_steps(executed):
    cell, out = ran(executed, "hf")
    assert out["value"] == 8
    steps = [row["step"] for row in out["history"]]
    assert steps[:4] == [2, 4, 6, 8], out["history"]  # logging_steps=2
    first = out["history"][0]
    assert {"loss", "learning_rate", "grad_norm"} <= set(first) and first["ranks"] == 2
    assert "epoch" not in first  # bookkeeping, not a metric
    assert any("eval_loss" in row and row["step"] == 4 for row in out["history"])
    assert not any("eval_runtime" in row for row in out["history"])
    bar, html = panel_state(executed, cell)
    assert (bar["value"], bar["max"]) == (8, 8)
    assert "eval_loss" in html and "learning_rate" in html


def test_a_lightning_trainer_reports_by_itself_per_step_and_per_epoch(executed):
    cell, out = ran(executed, "lightning")
    assert out["value"].count("NbddpCallback") == 1  # from the entry point, once
    history = out["history"]
    names = set().union(*history)
    assert {"train_loss_step", "train_loss_epoch", "val_loss"} <= names, names
    assert "train_loss" not in names  # Lightning's unsuffixed copy is left out
    per_step = [row["step"] for row in history if "train_loss_step" in row]
    assert per_step == list(range(1, 9)), history  # 64 samples / 8 / 2 ranks, 2 epochs
    bar, html = panel_state(executed, cell)
    assert (bar["value"], bar["max"]) == (8, 8)
    assert "epoch 1" in html and "val_loss" in html


def test_lightning_fabric_logs_through_its_logger_averaged_over_ranks(executed):
    cell, out = ran(executed, "fabric")
    assert out["value"] == 2
    history = out["history"]
    assert [row["step"] for row in history] == list(range(6))
    assert all(row["ranks"] == 2 and row["rank"] == 0.5 for row in history)  # (0 + 1) / 2
    bar, _ = panel_state(executed, cell)
    assert (bar["value"], bar["max"]) == (6, 6)


def test_accelerate_logs_from_its_main_process_and_is_shown_at_once(executed):
    cell, out = ran(executed, "accelerate")
    assert out["value"] == 4  # 64 samples / 8 / 2 ranks
    history = out["history"]
    assert [row["step"] for row in history] == [0, 1, 2, 3]
    # Accelerate logs on its main process only: rank 0's values, not waited for.
    assert all(row["ranks"] == 1 and row["rank"] == 0 for row in history)
    bar, html = panel_state(executed, cell)
    assert (bar["value"], bar["max"]) == (4, 4)
    assert "<b>loss</b>" in html
