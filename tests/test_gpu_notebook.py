"""The GPU path as a notebook user meets it, in a real Jupyter kernel (marked ``gpu``;
skipped where no GPU is visible, as in CI).

One kernel, cells in the order a user runs them: CUDA touched in the kernel first, then
``%%ddp --gpus 1`` training with DDP on NCCL, ``nbddp.launch(fn, gpus=1)``, a launch
asking for more GPUs than there are, and a session that keeps a model on the GPU across
cells, brings it back with ``--out``, and survives an interrupt and a timeout.
"""

from __future__ import annotations

import pytest

from nbddp._run.devices import visible_gpu_count

from .conftest import descendants

GPUS = visible_gpu_count()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU; none is visible")]

TRAIN = """%%ddp --gpus 1
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(50):
    x = torch.randn(64, 8, device="cuda")
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    nbddp.log(step=step, loss=loss)
print(f"backend={dist.get_backend()} device={torch.cuda.current_device()} "
      f"loss={loss.item():.4f}")
"""


@pytest.fixture(scope="module")
def gpu_kernel(kernel):
    """The module's kernel (``conftest.kernel``) with torch imported and the magics on."""
    kernel.run("import torch, nbddp\n%load_ext nbddp").assert_ok()
    return kernel


def test_a_kernel_that_touched_cuda_trains_with_ddp_on_nccl(gpu_kernel):
    gpu_kernel.run("_ = torch.zeros(1, device='cuda'); torch.cuda.is_initialized()"
                   ).assert_ok()
    run = gpu_kernel.run(TRAIN, timeout=180).assert_ok()
    text = run.stream_text()
    assert "backend=nccl device=0" in text, run.describe()
    loss = float(text.split("loss=")[1].split()[0])
    assert loss < 1.0, run.describe()  # it learned the sum


def test_launch_with_a_gpu_from_the_same_kernel(gpu_kernel):
    run = gpu_kernel.run("""
def where():
    import torch, torch.distributed as dist
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    return dist.get_backend(), str(t.device), t
backend, device, t = nbddp.launch(where, gpus=1)
(backend, device, str(t.device), t.item())
""", timeout=180).assert_ok()
    assert run.result() == "('nccl', 'cuda:0', 'cpu', 1.0)", run.describe()


def test_more_gpus_than_the_machine_has_is_a_clear_error_before_anything_starts(
        gpu_kernel):
    run = gpu_kernel.run(f"%%ddp --gpus {GPUS + 1}\nprint('the body ran')", timeout=60)
    said = run.stream_text("stderr")  # (a magic's bad arguments: IPython's UsageError)
    assert f"UsageError: --gpus {GPUS + 1} asks for more GPUs than the {GPUS} visible" in said
    assert "the body ran" not in run.stream_text(), run.describe()
    assert not descendants(gpu_kernel.pid)


def test_a_gpu_session_keeps_a_model_on_the_gpu_and_brings_it_back(gpu_kernel):
    gpu_kernel.run("%ddp_session start --gpus 1", timeout=180).assert_ok()
    try:
        gpu_kernel.run("""%%ddp
import torch
torch.manual_seed(0)
net = torch.nn.Linear(8, 1).cuda()
opt = torch.optim.SGD(net.parameters(), lr=0.05)
""", timeout=120).assert_ok()
        run = gpu_kernel.run("""%%ddp --out net
for step in range(100):
    x = torch.randn(64, 8, device="cuda")
    loss = (net(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
print(f"on={next(net.parameters()).device} loss={loss.item():.4f}")
""", timeout=120).assert_ok()
        assert "on=cuda:0" in run.stream_text(), run.describe()
        back = gpu_kernel.run("(str(next(net.parameters()).device), "
                              "round(float(net.weight.sum()), 1))").assert_ok()
        assert back.result().startswith("('cpu', "), back.describe()
        assert abs(float(back.result().split(", ")[1].rstrip(")")) - 8.0) < 1.0

        run = gpu_kernel.submit("""%%ddp
import time
x = torch.ones(1024, 1024, device="cuda")
print("working", flush=True)
while True:
    x = (x @ x).clamp_(max=1.0)
    torch.cuda.synchronize()
""")
        run.wait_for_output("working", timeout=60)
        gpu_kernel.km.interrupt_kernel()
        run.finish(timeout=60)
        assert run.error()["ename"] == "KeyboardInterrupt", run.describe()
        assert "with their state" in run.error_text()

        run = gpu_kernel.run("%%ddp --timeout 3\nwhile True:\n    x = (x @ x).clamp_(max=1.0)",
                             timeout=120)
        assert run.error()["ename"] == "TimeoutError", run.describe()
        still = gpu_kernel.run("%%ddp\nprint(str(next(net.parameters()).device))",
                               timeout=60).assert_ok()
        assert "cuda:0" in still.stream_text(), still.describe()
    finally:
        gpu_kernel.run("%ddp_session stop", timeout=120)
