"""The integrations' pure parts: which logged values are charted, and Lightning's names."""

from __future__ import annotations

import importlib
import math

import pytest

from nbddp.integrations._numbers import chartable

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


def test_only_the_trainings_own_numbers_are_charted():
    torch = pytest.importorskip("torch")
    logs = {"loss": 1.5, "learning_rate": 1e-4, "grad_norm": torch.tensor(0.3), "epoch": 0.5,
            "eval_runtime": 0.02, "eval_samples_per_second": 3000.0, "total_flos": 1e12,
            "note": "text", "done": True, "vector": torch.ones(3), "bad": math.nan}
    kept = chartable(logs)
    assert set(kept) == {"loss", "learning_rate", "grad_norm", "bad"}


def test_lightning_sends_what_its_loggers_get():
    from nbddp.integrations._lightning_common import _as_logged

    metrics = {"loss": 1, "loss_step": 1, "loss_epoch": 2, "val_loss": 3}
    assert _as_logged(metrics) == {"loss_step": 1, "loss_epoch": 2, "val_loss": 3}


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_outside_a_run_the_entry_point_adds_no_callback(package):
    pytest.importorskip(package)
    integration = importlib.import_module(f"nbddp.integrations.{package}")
    assert integration.callbacks_in_a_run() == []
