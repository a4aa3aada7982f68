"""Accelerate in an nbddp run: ``accelerator.log`` goes to the panel.

    from nbddp.integrations.accelerate import NbddpTracker
    accelerator = Accelerator(log_with=NbddpTracker())
    accelerator.init_trackers("my-run")
    ...
    accelerator.log({"loss": loss.item()}, step=step)

Accelerate's ``log`` runs on the main process only, so its values stand for every rank:
the panel shows them at once instead of waiting for the other ranks.
"""

from __future__ import annotations

from typing import Any

from accelerate.tracking import GeneralTracker

from .._rank.metrics import log_for_all
from ._numbers import chartable

__all__ = ["NbddpTracker"]


class NbddpTracker(GeneralTracker):  # type: ignore[misc]
    """An Accelerate tracker whose ``log`` feeds nbddp's panel and history."""

    name = "nbddp"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str = "nbddp") -> None:
        super().__init__()
        self.run_name = run_name

    @property
    def tracker(self) -> None:
        return None  # nothing of a third party's to hand out

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Hyperparameters are not charted."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        metrics = chartable(values)
        if metrics:
            log_for_all(step, metrics)
