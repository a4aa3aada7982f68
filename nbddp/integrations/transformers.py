"""Hugging Face ``Trainer`` in an nbddp run: its logs and its step count in the panel.

    from nbddp.integrations.transformers import NbddpCallback
    trainer = Trainer(model, args, train_dataset=..., callbacks=[NbddpCallback()])

Transformers has no hook that would add a callback by itself, so it is passed by hand.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from .._rank.metrics import log_for_all, set_progress, step_begins, step_ends, steps_paused
from ._numbers import chartable

__all__ = ["NbddpCallback"]


class NbddpCallback(TrainerCallback):  # type: ignore[misc]
    """What the Trainer logs (loss, learning rate, grad norm, eval metrics) goes to the
    panel at the Trainer's global step; the progress bar follows ``global_step`` of
    ``max_steps``. The Trainer logs values already reduced over the ranks, the same on
    each, so rank 0's are sent as speaking for all: shown at once, not waited for."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        set_progress(state.global_step, state.max_steps or None, "training")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step_begins()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step_ends()
        epoch = f"epoch {state.epoch:.2f}" if state.epoch is not None else "training"
        set_progress(state.global_step, state.max_steps or None, epoch)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        steps_paused()  # the evaluation was no wait for data

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        steps_paused()  # nor the checkpoint

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        metrics = chartable(logs or {})
        if metrics and state.is_world_process_zero:
            log_for_all(state.global_step, metrics)
