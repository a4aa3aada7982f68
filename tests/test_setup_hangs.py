"""A hang in process-group set-up says why: real launches, each with small code that
makes one of the mistakes seen in the wild, stopped by their timeout. What the user
reads is the ``TimeoutError``: each rank's summary names ``init_process_group`` (not
torch's helpers), and the set-up report names the cause nbddp can see, or what it
looked at where it sees none. Nothing is left running, the processes a rank started
included. Unit tests of the report first.
"""

from __future__ import annotations

import re

import pytest

import nbddp
from nbddp._run.diagnosis.setup_report import setup_report
from nbddp._wire.hang_messages import Collectives, SetupLook

from .conftest import wait_until

pytestmark = pytest.mark.waits  # the waiting lane (tests/conftest.py)

# --- the report, from the ranks' looks ----------------------------------------------------


def looks(**by_rank: SetupLook | None) -> dict[int, Collectives]:
    return {int(rank[1:]): Collectives(int(rank[1:]), 1, unavailable="no process group",
                                       setup=look) for rank, look in by_rank.items()}


def inside(rank: int | None, torchrun_rank: int, world_size: int | None = None,
           **more) -> SetupLook:
    return SetupLook(True, rank, world_size, torchrun_rank=torchrun_rank,
                     torchrun_world_size=2, **more)


@pytest.mark.fast
def test_ranks_that_join_as_the_same_rank_are_named():
    report = setup_report(looks(r0=inside(0, 0), r1=inside(0, 1)))
    assert "rank 1 called init_process_group(rank=0); torchrun made it rank 1" in report
    assert "ranks 0 and 1 both joined as rank 0" in report
    assert "rank 0 called" not in report  # rank 0 is where torchrun put it


@pytest.mark.fast
def test_a_world_size_torchrun_did_not_start_is_named():
    report = setup_report(looks(r0=inside(0, 0, 3), r1=inside(1, 1, 3)))
    assert "rank 0 called init_process_group with world_size=3; torchrun started 2 " \
        "ranks" in report
    assert "both joined" not in report


@pytest.mark.fast
def test_with_no_cause_found_it_says_what_it_looked_at_and_who_is_missing():
    report = setup_report(looks(r0=inside(0, 0), r1=None))
    assert "rank 0 is in init_process_group with the rank and world size torchrun gave, " \
        "MASTER_ADDR and MASTER_PORT unchanged" in report
    assert "nbddp found no cause there" in report
    assert "rank 1 is not in init_process_group" in report


@pytest.mark.fast
def test_no_rank_in_set_up_and_nothing_changed_says_nothing():
    assert setup_report(looks(r0=None, r1=None)) == ""


# --- real launches ------------------------------------------------------------------------

TIMEOUT = 15


def timeout_report(fn, timeout: float = TIMEOUT) -> str:
    """What the user reads when ``fn``'s launch on 2 ranks hangs and times out."""
    with pytest.raises(TimeoutError) as caught:
        nbddp.launch(fn, 2, init=False, timeout=timeout, output="none")
    return str(caught.value)


def same_rank_everywhere():
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=2)  # a get_rank() that says 0


def three_ranks():
    import torch.distributed as dist

    dist.init_process_group("gloo", world_size=3)


def free_port() -> int:
    """A port free on this machine now (on a rank: each rank its own)."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def another_port():
    import os

    import torch.distributed as dist

    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo")


def another_address():
    import os

    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "10.255.255.1"  # (nobody answers there)
    dist.init_process_group("gloo")


def a_trainer_whose_cluster_says_rank_0_everywhere():
    """A framework's own set-up broken as perceptrain's is: its cluster environment says
    rank 0 on every rank, and Lightning passes that to init_process_group."""
    import lightning.pytorch as pl
    import torch
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    class EveryRankIsRankZero(TorchElasticEnvironment):
        def global_rank(self) -> int:
            return 0

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, _):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1,
                         plugins=[EveryRankIsRankZero()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Tiny(), data)


def an_address_of_its_own():
    import os

    import torch.distributed as dist

    port = free_port()  # (each rank its own: none hosts a store there anyway)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=int(os.environ["RANK"]), world_size=2)


WORKERS = """
import sys, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2],
                        rank=int(sys.argv[1]), world_size=2)
"""


def workers_of_its_own():
    """What VISSL does: the rank starts worker processes that set up a group of their own
    at an address of their own; they inherit torchrun's environment."""
    import subprocess
    import sys

    import torch.distributed as dist

    if dist.is_torchelastic_launched() and __import__("os").environ["RANK"] == "0":
        port = str(free_port())
        workers = [subprocess.Popen([sys.executable, "-c", WORKERS, str(i), port])
                   for i in range(2)]
        for worker in workers:
            worker.wait()


def one_rank_elsewhere():
    import os
    import time

    import torch.distributed as dist

    if os.environ["RANK"] == "1":
        time.sleep(60)  # never reaches init_process_group
    dist.init_process_group("gloo")


@pytest.mark.slow
def test_two_ranks_that_join_as_rank_0_are_named_with_the_cause():
    report = timeout_report(same_rank_everywhere)
    assert re.search(r"rank 0: waiting in init_process_group \(test_setup_hangs.py, line \d+",
                     report), report
    assert "rank 1: waiting in init_process_group" in report, report
    assert "rank 1 called init_process_group(rank=0); torchrun made it rank 1" in report
    assert "ranks 0 and 1 both joined as rank 0" in report, report
    assert "_new_process_group_helper (" not in report  # torch's helper is no summary


@pytest.mark.slow
def test_asked_while_it_hangs_the_job_names_the_call_and_the_cause():
    """Asked for (``job.stacks()``, ``job.hang_report()``), before any timeout: each
    rank's stack names init_process_group, and the report the cause."""
    job = nbddp.launch(same_rank_everywhere, 2, init=False, wait=False, output="none")
    try:
        report = wait_until(lambda: (said if "both joined as rank 0" in
                                     (said := job.hang_report()) else None), timeout=60)
        assert "rank 1 called init_process_group(rank=0); torchrun made it rank 1" \
            in report, report
        stacks = job.stacks()
        for rank in (0, 1):
            assert stacks[rank].startswith(f"rank {rank}: waiting in init_process_group "
                                           "(test_setup_hangs.py"), stacks[rank]
    finally:
        job.cancel()


@pytest.mark.slow
def test_a_world_size_of_its_own_is_named():
    report = timeout_report(three_ranks)
    assert "rank 0 called init_process_group with world_size=3; torchrun started 2 ranks" \
        in report, report
    assert "rank 1 called init_process_group with world_size=3" in report, report


@pytest.mark.slow
@pytest.mark.parametrize("changes, name, to", [(another_port, "MASTER_PORT", r"\d+"),
                                               (another_address, "MASTER_ADDR", "10.255.255.1")],
                         ids=["port", "address"])
def test_a_master_port_or_address_the_rank_changed_is_named(changes, name, to):
    report = timeout_report(changes)
    assert re.search(rf"rank 0 changed {name} from \S+ \(torchrun's\) to {to}: under "
                     r"torchrun \(TORCHELASTIC_USE_AGENT_STORE=True\) every rank looks for "
                     r"torchrun's store there, and none hosts one", report), report
    assert f"rank 1 changed {name}" in report, report


@pytest.mark.slow
def test_a_frameworks_own_broken_set_up_is_named_with_the_cause():
    """Lightning's Trainer makes the call (a frame of the framework's, not the user's):
    the summary still names init_process_group, and the report the cause."""
    pytest.importorskip("lightning")
    # Importing Lightning takes each rank 10 s of CPU on a quiet 2-core machine, and a
    # loaded CI runner twice that: the timeout must find both ranks past their imports.
    report = timeout_report(a_trainer_whose_cluster_says_rank_0_everywhere, timeout=75)
    assert "rank 0: waiting in init_process_group" in report, report
    assert "rank 1: waiting in init_process_group" in report, report
    assert "rank 1 called init_process_group(rank=0); torchrun made it rank 1" in report
    assert "ranks 0 and 1 both joined as rank 0" in report, report
    assert "_new_process_group_helper (" not in report, report


@pytest.mark.slow
def test_an_init_method_of_its_own_beside_torchruns_agent_store_is_named():
    report = timeout_report(an_address_of_its_own)
    assert re.search(r"rank 0 called init_process_group with init_method='tcp://127.0.0.1:"
                     r"\d+', but torchrun tells every rank to use its agent store "
                     r"\(TORCHELASTIC_USE_AGENT_STORE=True\): no rank hosts a store there",
                     report), report


@pytest.mark.slow
def test_processes_a_rank_started_on_torchruns_agent_store_are_named_with_the_fix():
    report = timeout_report(workers_of_its_own)
    assert "rank 0: in wait (subprocess)" in report, report
    found = re.search(r"rank 0 started processes that inherited torchrun's "
                      r"TORCHELASTIC_USE_AGENT_STORE=True \(pid \d+: \S*python\S* -c .*; pid "
                      r"\d+: .*\): if they set up a process group, it waits for torchrun's "
                      r"agent store, which none of them hosts", report)
    assert found, report
    assert "os.environ.pop('TORCHELASTIC_USE_AGENT_STORE', None)" in report


@pytest.mark.slow
def test_where_it_finds_no_cause_it_says_what_it_looked_at():
    report = timeout_report(one_rank_elsewhere)
    assert "rank 0 is in init_process_group with the rank and world size torchrun gave" \
        in report, report
    assert "nbddp found no cause there" in report
    assert "rank 1 is not in init_process_group: the ranks inside wait there until every " \
        "rank has called it" in report, report


@pytest.mark.slow
def test_the_cause_is_said_when_the_run_looks_stalled_before_any_timeout(capfd):
    """A framework's broken set-up is explained within the stall time, as it happens."""
    with pytest.raises(TimeoutError):
        nbddp.launch(same_rank_everywhere, 2, init=False, stall_after=6, timeout=TIMEOUT)
    out = capfd.readouterr().out
    stalled = out.index("nbddp: the run looks stalled")
    said = out.index("ranks 0 and 1 both joined as rank 0", stalled)
    assert said < out.index("nbddp: timed out"), out


def a_worker_beside_a_collective_hang():
    """A rank with a process group starts a process (as a DataLoader's workers do), and
    the ranks hang in a collective, not in set-up."""
    import os
    import subprocess
    import sys
    import time

    import torch.distributed as dist

    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        if os.environ["RANK"] == "0":
            dist.barrier()  # rank 1 never comes
        else:
            time.sleep(60)
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.slow
def test_a_collective_hang_beside_a_ranks_own_processes_blames_no_set_up():
    with pytest.raises(TimeoutError) as caught:
        nbddp.launch(a_worker_beside_a_collective_hang, 2, timeout=TIMEOUT, output="none")
    report = str(caught.value)
    assert "rank 0: waiting in barrier" in report, report
    assert "process-group set-up" not in report and "started processes" not in report, report
    assert "barrier #1 waits for rank 1" in report, report
