"""What frameworks print on rank 0 looks right under the cell: Lightning's progress bars
in a real kernel (nested bars, cursor-up codes) and in the text fallback.

The ranks' terminal output is played on a screen model in the kernel (``_panel.terminal``):
the cell keeps final lines, and bars still running are updated in place in a display.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

CURSOR_CODES = re.compile(r"\x1b\[[0-9;?]*[A-HJKSTfhlnsu]")
"""Escape codes that move the cursor or erase (colours, ``m``, may stay)."""

FIT = """
import lightning as L
import torch

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _):
        loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, _):
        self.log("val", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]),
                 prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = torch.utils.data.DataLoader(data, batch_size=4)
callbacks = {callbacks}
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2,
                    logger=False, enable_checkpointing=False, enable_progress_bar=True,
                    callbacks=callbacks)
trainer.fit(Net(), loader, loader)
"""
PANEL_BAR = re.compile(r"\r(?: +\r|epoch \d+:[^\r\n]*)")
"""The text panel's own bar (nbddp's, fed by the Lightning integration): tqdm, redrawn."""
TQDM_BAR = "[L.pytorch.callbacks.TQDMProgressBar()]"
"""Lightning's default bar where rich is not installed: tqdm, with a nested validation bar."""


def stored_outputs(run) -> list[tuple[str, str]]:
    """(kind, text) of each output a notebook would save for the cell, as nbclient keeps
    them: a display's updates replace what it shows."""
    outputs: list[list[str]] = []
    by_id: dict[str, list[list[str]]] = {}
    for o in run.outputs:
        text = o.content.get("data", {}).get("text/plain", "")
        display_id = o.content.get("transient", {}).get("display_id")
        if o.msg_type == "update_display_data":
            for output in by_id.get(display_id, []):
                output[1] = text
            continue
        output = [o.msg_type, o.content["text"] if o.msg_type == "stream" else text]
        outputs.append(output)
        if display_id:
            by_id.setdefault(display_id, []).append(output)
    return [(kind, text) for kind, text in outputs]


def check_clean(text: str) -> None:
    assert not CURSOR_CODES.search(text), repr(CURSOR_CODES.search(text))
    assert "\r" not in text


@pytest.mark.slow
@pytest.mark.parametrize("bar", ["default", "tqdm"])
def test_lightning_progress_bars_in_a_kernel_leave_clean_lines(kernel, bar):
    pytest.importorskip("lightning")
    kernel.run("%load_ext nbddp").assert_ok()
    callbacks = TQDM_BAR if bar == "tqdm" else "[]"
    run = kernel.run("%%ddp --nprocs 2 --no-init\n" + FIT.format(callbacks=callbacks),
                     timeout=300).assert_ok()
    stored = stored_outputs(run)
    text = "\n".join(text for _, text in stored)
    check_clean(text)
    assert "GPU available: False" in text  # Lightning's own lines are there, once
    assert text.count("GPU available") == 1
    epoch_lines = [line for line in text.splitlines() if "Epoch " in line]
    assert 1 <= len(epoch_lines) <= 4, text  # the bar's last state, not one line a refresh
    if bar == "tqdm":
        assert any("Epoch 1: 100%" in line for line in epoch_lines), text
        assert "`Trainer.fit` stopped: `max_epochs=2` reached." in text
        # While it ran, the bar was shown in place, at most ten times a second.
        live = [o for o in run.outputs if o.msg_type in ("display_data", "update_display_data")
                and "Epoch" in o.content["data"].get("text/plain", "")]
        assert live, run.describe()
        seconds = live[-1].arrived - live[0].arrived
        assert len(live) <= 10 * seconds + 5
        for o in run.outputs:  # what the front end got along the way, too
            check_clean(o.content.get("text", "") + o.content.get("data", {}).get(
                "text/plain", ""))
    else:
        assert any("Epoch 1" in line for line in epoch_lines), text


@pytest.mark.slow
def test_lightning_progress_bar_in_the_text_fallback_leaves_clean_lines(tmp_path):
    pytest.importorskip("lightning")
    script = tmp_path / "fit.py"
    script.write_text(textwrap.dedent("""
        import nbddp

        def fit():
        {body}

        nbddp.launch(fit, nprocs=2, init=False, timeout=300)
        print("launched")
    """).format(body=textwrap.indent(FIT.format(callbacks=TQDM_BAR), "    ")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=300,
                          cwd=tmp_path)  # bytes: text mode would turn "\r" into "\n"
    out = done.stdout.decode()
    assert done.returncode == 0, out + done.stderr.decode()
    assert not CURSOR_CODES.search(out)
    out = PANEL_BAR.sub("", out)  # what is left came from the ranks, and nbddp's lines
    check_clean(out)
    assert "launched" in out
    assert "Epoch 1: 100%" in out
    assert len([line for line in out.splitlines() if "Epoch " in line]) <= 4, out
