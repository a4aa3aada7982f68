"""Frameworks inside a launch: their own process group, their own idea of the cluster.

Lightning installs beside the CPU torch (``scripts/test.sh``); where it is missing the
test skips itself.
"""

from __future__ import annotations

import pytest

import nbddp

from .test_restarts import ALLOCATION


def fits_with_lightning():
    """A tiny Lightning fit on this rank: the world it saw, and the steps it took."""
    import lightning as L
    import torch
    from lightning.fabric.plugins.environments import SLURMEnvironment

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=8))
    environment = type(trainer.strategy.cluster_environment).__name__
    return (trainer.global_rank, trainer.world_size, environment, SLURMEnvironment.detect(),
            trainer.global_step)


def test_lightning_in_a_kernel_inside_an_allocation_trains_on_its_local_ranks(monkeypatch):
    """The kernel carries a compute node's SLURM variables (SLURM_NTASKS=8...), which
    Lightning takes for a SLURM job of its own (its SLURM detection, its SIGUSR1
    requeue handler; older versions chose it over torchrun's environment). The
    local ranks never see them: Lightning finds torchrun's 2 ranks and nothing else."""
    pytest.importorskip("lightning")
    for name, value in ALLOCATION.items():
        monkeypatch.setenv(name, value)
    ranks = nbddp.launch(fits_with_lightning, nprocs=2, init=False, all_ranks=True,
                         timeout=300)
    assert ranks == [(0, 2, "TorchElasticEnvironment", False, 4),
                     (1, 2, "TorchElasticEnvironment", False, 4)]
