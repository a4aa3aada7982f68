"""Models come back whole: DDP, torch.compile, FSDP (both APIs) and DTensors.

Real runs on CPU with gloo: each model is trained on two ranks, each rank its own data,
and what comes back is compared with the same model trained in this process on both
ranks' data (DDP and FSDP average the gradients: the same as averaging the losses).
The fast tests at the top need no process group.
"""

from __future__ import annotations

import collections
import sys
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn

import nbddp
from nbddp._rank.whole import make_whole

pytestmark = pytest.mark.waits  # the waiting lane (tests/conftest.py)

STEPS = 3


class Net(nn.Module):
    """A little of everything: two layers, a frozen parameter, a persistent buffer and
    a non-persistent one (which a state dict leaves out)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)
        self.offset = nn.Parameter(torch.full((3,), 0.5), requires_grad=False)
        self.register_buffer("scale", torch.full((3,), 2.0))
        self.register_buffer("table", torch.arange(3.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.scale + self.offset + self.table


class Checkpoint(NamedTuple):
    model: Any
    step: int


def batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(5, 4, generator=g) for _ in range(STEPS)]


def train(model: nn.Module, rank: int) -> nn.Module:
    """``STEPS`` steps of SGD on rank ``rank``'s data (``model`` as it is: wrapped)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for x in batches(rank):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return model


def reference() -> Net:
    """Net trained here on both ranks' data, as DDP and FSDP train it on two ranks."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for x0, x1 in zip(batches(0), batches(1), strict=True):
        opt.zero_grad()
        ((model(x0).pow(2).mean() + model(x1).pow(2).mean()) / 2).backward()
        opt.step()
    return model


def assert_whole(model: Any, expected: nn.Module) -> None:
    """``model`` is a plain ``Net`` (the classes all the user's own) on the CPU, with
    ``expected``'s weights, and it runs."""
    assert type(model) is Net, type(model)
    assert type(model.a) is nn.Linear and type(model.b) is nn.Linear
    state, want = model.state_dict(), expected.state_dict()
    assert sorted(state) == sorted(want)
    for name, tensor in state.items():
        assert type(tensor) is torch.Tensor and tensor.device.type == "cpu", name
        torch.testing.assert_close(tensor, want[name], msg=name)
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert not model.offset.requires_grad and model.a.weight.requires_grad
    assert torch.equal(model.table, torch.arange(3.0))  # the non-persistent buffer too
    Net().load_state_dict(state)  # strict: no key missing or left over
    x = torch.randn(2, 4)
    torch.testing.assert_close(model(x), expected(x))


# --- no process group -----------------------------------------------------------------


def fake_ddp(module: nn.Module) -> nn.Module:
    """A ``DistributedDataParallel`` around ``module``, made without a process group."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel.__new__(DistributedDataParallel)
    nn.Module.__init__(ddp)
    ddp.module = module
    return ddp


def test_the_walk_unwraps_inside_dicts_lists_and_tuples_and_keeps_their_types():
    net = Net()
    ddp = fake_ddp(net)
    untouched = [1, "two", torch.ones(2)]
    value = {
        "model": ddp,
        "nested": [1, (ddp, 2.0)],
        "ordered": collections.OrderedDict(m=ddp),
        "default": collections.defaultdict(list, m=ddp),
        "named": Checkpoint(ddp, 7),
        "untouched": untouched,
        "numbers": list(range(10_000)),
    }
    whole = make_whole(value)
    assert whole is not value and value["model"] is ddp  # the rank's value is unchanged
    assert whole["model"] is net and whole["nested"] == [1, (net, 2.0)]
    assert type(whole["ordered"]) is collections.OrderedDict and whole["ordered"]["m"] is net
    assert type(whole["default"]) is collections.defaultdict
    assert whole["default"].default_factory is list and whole["default"]["m"] is net
    assert whole["named"] == Checkpoint(net, 7) and type(whole["named"]) is Checkpoint
    assert whole["untouched"] is untouched and whole["numbers"] is value["numbers"]


def test_nothing_to_unwrap_gives_the_same_objects_back():
    net, tensor = Net(), torch.ones(3)
    loop: list[Any] = [net]
    loop.append(loop)  # a list inside itself
    for value in (None, 3, "x", tensor, net, {"a": [net, tensor]}, loop):
        assert make_whole(value) is value


def test_without_torch_nothing_is_looked_at(monkeypatch):
    value = {"a": object()}
    monkeypatch.setitem(sys.modules, "torch", None)
    assert make_whole(value) is value


def test_compiled_and_ddp_wrappers_give_the_users_module_itself():
    net = Net()
    compiled = torch.compile(net, backend="eager")
    assert make_whole(compiled) is net
    assert make_whole(torch.compile(fake_ddp(net), backend="eager")) is net
    assert make_whole(fake_ddp(compiled)) is net


def test_wrappers_inside_a_module_give_a_plain_copy_that_shares_the_tensors():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        checkpoint_wrapper,
    )

    class Counter:
        calls = 0

        def hook(self, module, args, output):
            Counter.calls += 1

    net = Net()
    net.register_forward_hook(Counter().hook)  # the user's hook stays
    net.a = checkpoint_wrapper(net.a)
    net.twin = net.b  # one module in two places
    whole = make_whole(net)
    assert type(net.a) is CheckpointWrapper  # the rank's module is unchanged
    assert type(whole) is Net and type(whole.a) is nn.Linear
    assert whole.twin is whole.b and whole.b is not net.b
    assert whole.a.weight is net.a._checkpoint_wrapped_module.weight  # shared, not copied
    x = torch.randn(2, 4)
    torch.testing.assert_close(whole(x), net(x))
    assert Counter.calls == 2
    assert sorted(whole.state_dict()) == sorted(net.state_dict())


# --- real runs ------------------------------------------------------------------------


def wrapped_models():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, mesh = dist.get_rank(), init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    ddp = train(DDP(Net()), rank)
    torch.manual_seed(0)
    compiled = train(torch.compile(DDP(Net()), backend="eager"), rank)
    torch.manual_seed(0)
    fsdp2 = Net()
    fully_shard(fsdp2.a, mesh=mesh)
    fully_shard(fsdp2, mesh=mesh)
    train(fsdp2, rank)
    torch.manual_seed(1)
    tp = parallelize_module(nn.Linear(4, 8), mesh, ColwiseParallel())
    tp.register_buffer("rows", distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]),
                       persistent=False)
    return {
        "ddp": ddp, "compiled": compiled, "fsdp2": fsdp2, "again": fsdp2,
        "checkpoint": Checkpoint(fsdp2, STEPS), "state": fsdp2.state_dict(), "tp": tp,
        "dtensor": distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)]),
        "shard_types": [type(fsdp2).__name__, type(fsdp2.a.weight).__name__],
    }


@pytest.mark.slow  # torch.compile and four models on two ranks
def test_ddp_compiled_fsdp2_tensor_parallel_and_dtensors_come_back_whole():
    result = nbddp.launch(wrapped_models, 2)
    expected = reference()
    for name in ("ddp", "compiled", "fsdp2"):
        assert_whole(result[name], expected)
    assert result["shard_types"] == ["FSDPNet", "DTensor"]  # it was sharded there
    assert result["again"] is result["fsdp2"]  # gathered once, shared as it was
    assert type(result["checkpoint"]) is Checkpoint and result["checkpoint"].step == STEPS
    assert result["checkpoint"].model is result["fsdp2"]
    state = result["state"]
    assert type(state) is collections.OrderedDict
    assert all(type(t) is torch.Tensor for t in state.values())
    assert expected.load_state_dict(state, strict=False).missing_keys == []
    torch.manual_seed(1)
    plain = nn.Linear(4, 8)
    assert type(result["tp"]) is nn.Linear
    torch.testing.assert_close(result["tp"].state_dict(), plain.state_dict())
    assert torch.equal(result["tp"].rows, torch.arange(8.0))
    assert torch.equal(result["dtensor"], torch.arange(8.0).reshape(4, 2))


def fsdp1_models():
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    rank, cpu = dist.get_rank(), torch.device("cpu")
    torch.manual_seed(0)
    flat = train(FSDP(Net(), device_id=cpu, auto_wrap_policy=ModuleWrapPolicy({nn.Linear})),
                 rank)
    torch.manual_seed(0)
    orig = train(FSDP(Net(), device_id=cpu, use_orig_params=True), rank)
    torch.manual_seed(0)
    checkpointed = Net()
    checkpointed.a = checkpoint_wrapper(checkpointed.a)
    fully_shard(checkpointed, mesh=init_device_mesh("cpu", (2,)))
    train(checkpointed, rank)
    return {"fsdp1": flat, "fsdp1_orig_params": orig, "fsdp2_checkpointed": checkpointed}


@pytest.mark.slow
def test_fsdp1_and_checkpointed_fsdp2_come_back_whole_on_every_rank():
    """FSDP1 on the CPU (its full state dict there cannot go through cpu_offload), and
    ``all_ranks``: every rank gets the full model."""
    results = nbddp.launch(fsdp1_models, 2, all_ranks=True)
    expected = reference()
    assert len(results) == 2
    for result in results:
        for name in ("fsdp1", "fsdp1_orig_params", "fsdp2_checkpointed"):
            assert_whole(result[name], expected)


def sharded_on_rank0_only():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Net()
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    return model if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_a_rank_that_returns_something_else_is_named_in_the_error():
    with pytest.raises(nbddp.WorkerError) as caught:
        nbddp.launch(sharded_on_rank0_only, 2)
    message = str(caught.value)
    assert "rank 0 could not gather the return value (FSDPNet)" in message, message
    assert "Every rank must return the same sharded models" in message, message


# --- through a notebook ---------------------------------------------------------------

NOTEBOOK_NET = """
import torch
import torch.nn as nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))
"""

FSDP2_CELL = """
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

{setup}
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(5, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
opt.zero_grad()
model(x).pow(2).mean().backward()
opt.step()
# the full weights, gathered by the cell itself on every rank, to compare with
expected = {{k: v.full_tensor() for k, v in model.state_dict().items()}}
"""

NEW_MODEL = """
torch.manual_seed(0)
model = Net()
fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
"""

CHECK = """
(
    type(model) is Net,
    type(model.a) is nn.Linear,
    sorted(model.state_dict()) == sorted(expected),
    all(torch.equal(v, expected[k]) for k, v in model.state_dict().items()),
    all(p.device.type == "cpu" and type(p) is nn.Parameter for p in model.parameters()),
    model(torch.ones(2, 4)).shape,
)
"""
CHECKED = "(True, True, True, True, True, torch.Size([2, 3]))"


@pytest.mark.slow  # a kernel, a one-off run and a session
def test_an_fsdp2_model_comes_back_whole_into_the_notebook_from_a_cell_and_a_session(kernel):
    kernel.run("%load_ext nbddp").assert_ok()
    kernel.run(NOTEBOOK_NET).assert_ok()
    run = kernel.run("%%ddp --nprocs 2 --out model,expected\n"
                     + FSDP2_CELL.format(setup=NEW_MODEL)).assert_ok()
    assert kernel.run(CHECK).assert_ok().result() == CHECKED, run.describe()

    # In a session the ranks keep their sharded model: sending it back leaves it as it
    # was, and the next cell trains it further.
    kernel.run("%ddp_session start --nprocs 2", timeout=120).assert_ok()
    try:
        run = kernel.run("%%ddp --out model,expected\n"
                         + FSDP2_CELL.format(setup=NEW_MODEL)).assert_ok()
        assert kernel.run(CHECK).assert_ok().result() == CHECKED, run.describe()
        kernel.run("first = model.a.weight.clone()").assert_ok()
        still_sharded = "assert type(model).__name__ == 'FSDPNet', type(model)"
        run = kernel.run("%%ddp --out model,expected\n"
                         + FSDP2_CELL.format(setup=still_sharded)).assert_ok()
        assert kernel.run(CHECK).assert_ok().result() == CHECKED, run.describe()
        changed = kernel.run("not torch.equal(first, model.a.weight)").assert_ok()
        assert changed.result() == "True", run.describe()
    finally:
        kernel.run("%ddp_session stop").assert_ok()
