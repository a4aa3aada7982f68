"""The older ``pytorch_lightning`` package in an nbddp run: as
``nbddp.integrations.lightning`` does for ``lightning``.

Many libraries (lightly-train among them) still build their Trainer from
``pytorch_lightning``, whose Trainer takes only ``pytorch_lightning`` callbacks and
loads its own ``pytorch_lightning.callbacks_factory`` entry point (declared in nbddp's
package metadata too): inside an nbddp run every ``pytorch_lightning.Trainer`` gets
``NbddpCallback`` by itself. ``NbddpLogger`` is for ``lightning_fabric.Fabric``. This
module imports only ``pytorch_lightning`` and ``lightning_fabric`` (which it brings):
its entry point loads where ``lightning`` is not installed.
"""

from __future__ import annotations

from typing import Any

from lightning_fabric.loggers import Logger
from pytorch_lightning import Callback

from . import _lightning_common
from ._lightning_common import FabricLogging, TrainerReporting

__all__ = ["NbddpCallback", "NbddpLogger", "callbacks_in_a_run"]


class NbddpCallback(TrainerReporting, Callback):  # type: ignore[misc]
    """A ``pytorch_lightning.Trainer`` callback: metrics the LightningModule logs
    (``self.log``) go to the panel at the Trainer's global step, each time their value
    changes; the progress bar follows the optimizer steps out of the Trainer's estimate
    of the total. Added by itself inside an nbddp run."""


class NbddpLogger(FabricLogging, Logger):  # type: ignore[misc]
    """A ``lightning_fabric.Fabric`` logger: ``fabric.log_dict(metrics, step)`` goes to
    the panel, averaged over ranks as ``nbddp.log`` is."""


def callbacks_in_a_run() -> list[Any]:
    """``pytorch_lightning``'s ``callbacks_factory`` entry point: inside an nbddp run,
    the callback that reports to the panel; elsewhere, none."""
    return _lightning_common.callbacks_in_a_run(NbddpCallback)
