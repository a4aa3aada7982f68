"""The integrations' pure parts: which logged values are charted, and Lightning's names."""

from __future__ import annotations

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
    pytest.importorskip("lightning")
    from nbddp.integrations.lightning import _as_logged, callbacks_in_a_run

    metrics = {"loss": 1, "loss_step": 1, "loss_epoch": 2, "val_loss": 3}
    assert _as_logged(metrics) == {"loss_step": 1, "loss_epoch": 2, "val_loss": 3}
    assert callbacks_in_a_run() == []  # outside an nbddp run: no callback
