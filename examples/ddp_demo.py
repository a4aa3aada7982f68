"""Train a small model with DDP on 2 CPU ranks through nbddp.launch, print the results.

Run: ``bash scripts/demo.sh`` (installs what it needs), or ``python examples/ddp_demo.py``.
"""

from __future__ import annotations

import nbddp


def train(epochs: int, steps_per_epoch: int = 50, batch: int = 64) -> dict:
    """Fit y = 3x0 - 2x1 + 1 with an MLP; every rank sees its own shard of the data."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts them)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1234 + rank)  # a different shard per rank
    history = []
    for epoch in range(epochs):
        total = torch.zeros(1)
        for _ in range(steps_per_epoch):
            x = torch.randn(batch, 2, generator=data)
            y = 3 * x[:, :1] - 2 * x[:, 1:] + 1
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.detach()
        dist.all_reduce(total)  # sum over ranks ...
        mean = total.item() / (world * steps_per_epoch)  # ... averaged over ranks and steps
        history.append(mean)
        if rank == 0:
            print(f"epoch {epoch}: rank-averaged loss {mean:.4f}")
    return {"world_size": world, "loss_per_epoch": history}


def main() -> None:
    result = nbddp.launch(train, nprocs=2, args=(5,))
    losses = result["loss_per_epoch"]
    print(f"\ntrained on {result['world_size']} ranks; rank-averaged loss per epoch:")
    for epoch, loss in enumerate(losses):
        print(f"  epoch {epoch}: {loss:.4f}")
    print(f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
