"""Lightning in an nbddp run: what a ``Trainer`` logs and how far it is, in the panel.

Inside an nbddp run every ``lightning.Trainer`` gets ``NbddpCallback`` by itself,
through Lightning's ``lightning.pytorch.callbacks_factory`` entry point (declared in
nbddp's package metadata): nothing to add to the Trainer. Passing one by hand is
harmless (one of them reports). Fabric has no such hook: pass ``NbddpLogger`` as
``Fabric(loggers=[NbddpLogger()])`` and ``fabric.log``/``log_dict`` reach the panel.
The older ``pytorch_lightning`` package has the same in
``nbddp.integrations.pytorch_lightning``.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.loggers import Logger
from lightning.pytorch import Callback

from . import _lightning_common
from ._lightning_common import FabricLogging, TrainerReporting

__all__ = ["NbddpCallback", "NbddpLogger", "callbacks_in_a_run"]


class NbddpCallback(TrainerReporting, Callback):  # type: ignore[misc]
    """A ``lightning.Trainer`` callback: metrics the LightningModule logs
    (``self.log``) go to the panel at the Trainer's global step, each time their value
    changes; the progress bar follows the optimizer steps out of the Trainer's estimate
    of the total. Added by itself inside an nbddp run."""


class NbddpLogger(FabricLogging, Logger):  # type: ignore[misc]
    """A Lightning Fabric logger: ``fabric.log_dict(metrics, step)`` goes to the panel,
    averaged over ranks as ``nbddp.log`` is."""


def callbacks_in_a_run() -> list[Any]:
    """Lightning's ``callbacks_factory`` entry point: inside an nbddp run, the callback
    that reports to the panel; elsewhere, none."""
    return _lightning_common.callbacks_in_a_run(NbddpCallback)
