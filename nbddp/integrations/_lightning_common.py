"""What nbddp's Lightning callback does, for both of Lightning's packages.

Lightning ships as ``lightning`` (``lightning.pytorch``) and as the older
``pytorch_lightning``, which many libraries still import. Each has its own ``Callback``
class, its own Trainer (which takes only its own package's callbacks) and its own
``callbacks_factory`` entry point. ``nbddp.integrations.lightning`` and
``nbddp.integrations.pytorch_lightning`` each mix ``TrainerReporting`` into their
package's ``Callback``, and import only that package: the entry point of one must load
where the other is not installed. This module imports neither.
"""

from __future__ import annotations

from typing import Any

from .._rank import metrics as _metrics
from .._rank.metrics import log, set_progress, step_begins, step_ends, steps_paused
from ._numbers import chartable


class TrainerReporting:
    """A Lightning ``Callback``'s hooks (mixed into each package's ``Callback``):
    metrics the LightningModule logs (``self.log``) go to the panel at the Trainer's
    global step, each time their value changes; the progress bar follows the optimizer
    steps out of the Trainer's estimate of the total.

    What a step logged (its batch, then perhaps its epoch's end and validation) is sent
    as one record once the next step begins, so the ranks' records of a step average
    into one row whatever order they arrive in."""

    def __init__(self) -> None:
        self._sent: dict[str, Any] = {}
        self._held: dict[str, Any] = {}
        self._held_step = -1
        self._reports = True
        self._total: int | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        ours = [cb for cb in trainer.callbacks if isinstance(cb, TrainerReporting)]
        self._reports = ours[0] is self  # one given by hand and one from the entry point

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._total = _total(trainer)
        if self._reports:
            set_progress(trainer.global_step, self._total, f"epoch {trainer.current_epoch}")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        if self._reports:
            step_begins()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._reports:
            step_ends()
            self._collect(trainer)
            set_progress(trainer.global_step, self._total, f"epoch {trainer.current_epoch}")

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._reports:
            steps_paused()  # the next epoch's start is no wait for data
            self._collect(trainer, by_value=True)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._reports:
            steps_paused()  # validating is no wait for data either

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._reports and not trainer.sanity_checking:
            self._collect(trainer, by_value=True)
            if trainer.state.fn != "fit":  # trainer.validate(): no step follows
                self._send()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._reports:
            self._send()

    def _collect(self, trainer: Any, by_value: bool = False) -> None:
        """Hold the metrics that are new since the last call. After each batch, a value
        is new if Lightning made a new tensor for it (no GPU value is read on the
        training thread); at an epoch's end, where Lightning makes every tensor afresh,
        only if its value changed."""
        if trainer.global_step != self._held_step:
            self._send()
            self._held_step = trainer.global_step
        metrics = _as_logged(trainer.callback_metrics)
        new = {name: value for name, value in metrics.items()
               if not _same(self._sent.get(name), value, by_value)}
        self._sent.update(new)
        self._held.update(chartable(new))

    def _send(self) -> None:
        if self._held:
            log(step=self._held_step, **self._held)
            self._held = {}


class FabricLogging:
    """A Fabric ``Logger``'s methods (mixed into each package's ``Logger``):
    ``fabric.log_dict(metrics, step)`` goes to the panel, averaged over ranks as
    ``nbddp.log`` is."""

    @property
    def name(self) -> str:
        return "nbddp"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        values = chartable(metrics)
        if values:
            log(step=step, **values)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Hyperparameters are not charted."""


def callbacks_in_a_run(callback: type) -> list[Any]:
    """A ``callbacks_factory`` entry point's answer: inside an nbddp run, ``callback``
    (the package's ``NbddpCallback``), which reports to the panel; elsewhere, none."""
    return [callback()] if _metrics.in_launched_run() else []


def _as_logged(metrics: dict[str, Any]) -> dict[str, Any]:
    """Lightning keeps ``x`` beside ``x_step`` and ``x_epoch`` for a value logged both
    per step and per epoch; its loggers get only the latter two, and so does the panel."""
    return {name: value for name, value in metrics.items()
            if f"{name}_step" not in metrics and f"{name}_epoch" not in metrics}


def _same(sent: Any, value: Any, by_value: bool) -> bool:
    if sent is value:
        return True
    if not by_value or sent is None:
        return False
    try:
        return bool(float(sent) == float(value))
    except (TypeError, ValueError, RuntimeError):
        return False


def _total(trainer: Any) -> int | None:
    """The optimizer steps the fit will take, as Lightning estimates them."""
    try:
        total = trainer.estimated_stepping_batches
    except Exception:  # e.g. an iterable dataset without a length and no max_steps
        return None
    return int(total) if total not in (None, float("inf")) else None
