"""nbddp.export: a notebook function as a script for torchrun, srun, python and sbatch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nbddp._export.script import cell_main, function_main, script_text
from nbddp._export.source import Standalone
from nbddp._slurm.options import SlurmOptions
from nbddp._slurm.sbatch import sbatch_text, submission_sbatch_text

from .conftest import wait_until
from .slurm import job_ended, job_info, submit

pytestmark = pytest.mark.waits  # the waiting lane (tests/conftest.py)

GOLDEN = Path(__file__).parent / "golden"


def check_golden(name: str, text: str) -> None:
    """Compare with tests/golden/NAME; NBDDP_UPDATE_GOLDEN=1 rewrites it."""
    path = GOLDEN / name
    if os.environ.get("NBDDP_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text()


def test_sbatch_text_is_pinned():
    options = SlurmOptions(nodes=2, nprocs_per_node=4, gpus_per_node=4, cpus_per_task=16,
                           time="01:00:00", partition="gpu", extra=("--account=proj",))
    check_golden("train.sbatch", sbatch_text("train.py", "train", options))


def test_script_text_is_pinned():
    needs = Standalone(imports=["import math", "import torch"],
                       definitions=["SCALE = 3", "def helper(x):\n    return x * SCALE\n",
                                    "def train(steps):\n    return helper(steps)\n"],
                       data={"weights": None, "_arg1": None})
    check_golden("train.py", script_text("`train`", "train.py", needs,
                                         function_main("train", "train(3, _arg1)"),
                                         "train.payload.pkl"))


def test_cell_script_text_is_pinned():
    needs = Standalone(imports=["import torch"], definitions=["SCALE = 3"])
    cell = "\nimport torch.distributed as dist\nx = torch.ones(1) * SCALE\ndist.all_reduce(x)\n"
    check_golden("cell.py", script_text("a cell", "cell.py", needs, cell_main(cell), None))


def port_of(text: str, job_id: int) -> int:
    """The rendezvous port a batch script's ``port=`` line gives job ``job_id`` (in bash)."""
    line = next(line for line in text.splitlines() if line.startswith("port="))
    done = subprocess.run(["bash", "-c", f'{line}; echo "$port"'], capture_output=True,
                          text=True, check=True, env={"SLURM_JOB_ID": str(job_id)})
    return int(done.stdout)


def test_each_exported_job_meets_on_a_port_of_its_own_as_a_submitted_job_does():
    """Two jobs that share a first node must not both listen on one port (it was 29500
    for every exported job): the port comes from the job id, as in a submission's."""
    exported = sbatch_text("train.py", "train", SlurmOptions(nodes=2))
    submitted = submission_sbatch_text("/runs/r1", "python", SlurmOptions(nodes=2))
    assert '--rdzv-endpoint "$head:$port" train.py' in exported
    for job_id in (7, 8, 19999, 20007, 123456):
        assert port_of(exported, job_id) == port_of(submitted, job_id) == 20000 + job_id % 20000
    assert port_of(exported, 7) != port_of(exported, 8)


def test_a_chosen_port_is_every_jobs_port():
    options = SlurmOptions(nodes=2, port=29400)
    for text in (sbatch_text("train.py", "train", options),
                 submission_sbatch_text("/runs/r1", "python", options)):
        assert port_of(text, 7) == port_of(text, 8) == 29400
    for bad in (0, 65536, "1; rm -rf ~", True):
        with pytest.raises(ValueError, match="rendezvous port"):
            SlurmOptions(port=bad)  # type: ignore[arg-type]


NOTEBOOK = """
import math
import torch
import nbddp

SCALE = 3
weights = torch.arange(4.0)  # no source: goes into the payload file

def helper(x):
    return x * SCALE

class Accumulator:
    def __init__(self):
        self.total = 0.0

    def add(self, value):
        self.total += value
        return self

def train(steps, offset=0.0):
    import torch.distributed as dist
    acc = Accumulator()
    for i in range(steps):
        acc.add(helper(i))
    t = torch.tensor([acc.total + weights.sum().item() + offset + math.floor(1.5)])
    dist.all_reduce(t)
    return t.item() / dist.get_world_size(), dist.get_world_size()

written = nbddp.export(train, "job/train.py", args=(3,), kwargs={"offset": 0.5},
                       nodes=2, nprocs=2)
[p.name for p in written]
"""
EXPECTED = 9 + 6 + 0.5 + 1  # helper(0..2) + sum(weights) + offset + floor(1.5)


def run_script(args: list[str], cwd: Path) -> str:
    """Run an exported script with no notebook and no nbddp on the import path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TMPDIR"] = str(cwd)  # where plain torchrun leaves its torchelastic_* log dirs
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def exported(kernel, tmp_path_factory):
    """A function defined in a real kernel's cells, exported into a folder."""
    folder = tmp_path_factory.mktemp("export")
    kernel.run(f"import os; os.chdir({str(folder)!r})").assert_ok()
    run = kernel.run(NOTEBOOK).assert_ok()
    assert run.result() == "['train.py', 'train.sbatch', 'train.payload.pkl']", run.describe()
    return folder / "job"


def test_the_script_is_the_notebooks_own_code(exported):
    text = (exported / "train.py").read_text()
    for line in ("import math", "import torch", "SCALE = 3", "def helper(x):",
                 "class Accumulator:", "def train(steps, offset=0.0):",
                 "weights = _data['weights']", "result = train(3, offset=0.5)"):
        assert line in text, line
    assert "import nbddp" not in text  # runs without nbddp installed
    compile(text, "train.py", "exec")


def test_the_script_runs_under_torchrun(exported):
    out = run_script([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc_per_node", "2", "train.py"], exported)
    assert f"train returned: ({EXPECTED}, 2)" in out


@pytest.mark.fast
def test_the_script_runs_as_plain_python(exported):
    assert f"train returned: ({EXPECTED}, 1)" in run_script([sys.executable, "train.py"],
                                                              exported)


LEAVING = """
import nbddp

def leave():
    import atexit, ctypes, threading, time
    import torch.distributed as dist
    rank = dist.get_rank()
    libc = ctypes.CDLL("libc.so.6")  # an abort among the C library's exit handlers, where
    getattr(libc, "__cxa_atexit")(libc.abort, None, None)  # gloo's destructors may abort

    def late():
        time.sleep(0.5)
        open(f"thread-{rank}.txt", "w").write("waited for")

    threading.Thread(target=late).start()
    atexit.register(lambda: open(f"atexit-{rank}.txt", "w").write("ran"))
    return rank

[p.name for p in nbddp.export(leave, "leaving/leave.py")]
"""


def test_a_clean_run_ends_well_though_a_library_would_abort_at_exit(kernel, tmp_path):
    """torch's gloo can abort in C++ static destructors after a clean run (torchrun then
    reports the job failed, SLURM too): the script leaves before them, once its threads
    are done and its exit handlers have run."""
    kernel.run(f"import os; _was = os.getcwd(); os.chdir({str(tmp_path)!r})").assert_ok()
    try:
        kernel.run(LEAVING).assert_ok()
    finally:
        kernel.run("os.chdir(_was)").assert_ok()
    folder = tmp_path / "leaving"
    for ranks, command in ((2, ["-m", "torch.distributed.run", "--standalone",
                                "--nproc_per_node", "2", "leave.py"]), (1, ["leave.py"])):
        run_script([sys.executable, *command], folder)
        for rank in range(ranks):
            assert (folder / f"thread-{rank}.txt").read_text() == "waited for"
            assert (folder / f"atexit-{rank}.txt").read_text() == "ran"
            (folder / f"thread-{rank}.txt").unlink()


def test_the_sbatch_file_asks_for_what_was_exported(exported):
    text = (exported / "train.sbatch").read_text()
    assert "#SBATCH --nodes=2" in text and "--nproc_per_node 2" in text
    assert "--rdzv-backend c10d" in text and "train.py" in text


@pytest.mark.slurm
def test_the_sbatch_job_runs_on_two_nodes_of_a_real_cluster(exported, slurm_env, jobs):
    """Two SLURM tasks, each a torchrun --nnodes 2, meet through c10d rendezvous: the
    all-reduce over 4 ranks proves both nodes took part."""
    job_id = submit(slurm_env, jobs, "--chdir", str(exported),
                    f"--export=ALL,TMPDIR={exported}",  # torchrun's log dirs stay in there
                    str(exported / "train.sbatch"))
    wait_until(lambda: job_ended(slurm_env, job_id) or
               job_info(slurm_env, job_id).get("JobState") in ("COMPLETED", "FAILED"),
               timeout=180, interval=0.5)
    out = (exported / f"train-{job_id}.out").read_text()
    err = (exported / f"train-{job_id}.err").read_text()
    assert f"train returned: ({EXPECTED}, 4)" in out, out + err
    wait_until(lambda: job_ended(slurm_env, job_id), timeout=60, interval=0.2)


@pytest.mark.slurm
def test_the_script_runs_under_srun_one_task_per_rank(exported, slurm_env, jobs):
    """No torchrun: srun starts the 4 ranks, and the script sets up the process group
    from SLURM's variables."""
    job_id = submit(slurm_env, jobs, "--nodes=2", "--ntasks-per-node=2", "--time=5",
                    "--chdir", str(exported), "--output", f"{exported}/srun-%j.out",
                    "--wrap", f"srun {sys.executable} train.py")
    wait_until(lambda: job_ended(slurm_env, job_id), timeout=180, interval=0.5)
    out = (exported / f"srun-{job_id}.out").read_text()
    assert f"train returned: ({EXPECTED}, 4)" in out, out


CELL = """
%%ddp --export cell_job/step.py --nprocs 2 --nodes 2 --time 00:10:00 --cpus-per-task 4 \
      --sbatch=--account=proj
import torch.distributed as dist
total = torch.tensor([helper(2) + weights.sum().item()])
dist.all_reduce(total)
if dist.get_rank() == 0:
    print(f"cell total {total.item()} over {dist.get_world_size()} ranks")
"""


@pytest.fixture(scope="module")
def exported_cell(exported, kernel):
    """A %%ddp --export cell, using the notebook's helper and tensor, in the same kernel."""
    kernel.run("%load_ext nbddp").assert_ok()
    run = kernel.run(CELL).assert_ok()
    assert "wrote cell_job/step.py, cell_job/step.sbatch" in run.stream_text(), run.describe()
    return exported.parent / "cell_job"


def test_an_exported_cell_runs_under_torchrun_and_python(exported_cell):
    text = (exported_cell / "step.py").read_text()
    assert "def helper(x):" in text and "weights = _data['weights']" in text
    assert "total = torch.tensor([helper(2) + weights.sum().item()])" in text
    out = run_script([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc_per_node", "2", "step.py"], exported_cell)
    assert "cell total 24.0 over 2 ranks" in out  # (helper(2) + 6) summed over 2 ranks
    assert "cell total 12.0 over 1 ranks" in run_script([sys.executable, "step.py"],
                                                        exported_cell)


def test_an_exported_cells_sbatch_has_the_magics_options(exported_cell):
    text = (exported_cell / "step.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --time=00:10:00", "#SBATCH --account=proj",
                 "#SBATCH --cpus-per-task=4",
                 "--nproc_per_node 2"):
        assert line in text, line


def test_export_with_gpus_on_a_machine_without_them(kernel, exported):
    run = kernel.run("%%ddp --export gpu_job/train.py --gpus 4\nx = 1").assert_ok()
    assert "wrote" in run.stream_text(), run.describe()
    assert "#SBATCH --gpus-per-node=4" in (exported.parent / "gpu_job/train.sbatch").read_text()


LOGGED = """
def logged(steps):
    import torch.distributed as dist
    for step in nbddp.progress(range(steps), desc="steps"):
        nbddp.log(step=step, loss=float(step + dist.get_rank()))
    return "logged"

nbddp.export(logged, "log_job/logged.py", args=(20,))
"""


def test_log_in_a_script_run_prints_and_writes_rank_averages(kernel, exported):
    kernel.run(LOGGED).assert_ok()
    folder = exported.parent / "log_job"
    env_dir = folder / "metrics"
    out = run_script(["env", f"NBDDP_METRICS_DIR={env_dir}", sys.executable, "-m",
                      "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                      "logged.py"], folder)
    assert out.count("[nbddp] step 19: loss=19.5 (mean of 2 ranks)") == 1, out  # (19 + 20) / 2
    rows = [json.loads(line) for line in (env_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": s, "ranks": 2, "loss": s + 0.5} for s in range(20)]


LOGGED_CELL = """
%%ddp --export cell_sbatch/steps.py --nodes 2 --nprocs 1 --time 00:10:00 --cpus-per-task 1
import torch.distributed as dist
for step in nbddp.progress(range(10), desc="steps"):
    nbddp.log(step=step, loss=float(step * (dist.get_rank() + 1)))
if dist.get_rank() == 0:
    print(f"cell done on {dist.get_world_size()} ranks", flush=True)
"""


@pytest.mark.slurm
def test_an_exported_cell_runs_via_sbatch_with_its_metrics(kernel, exported, slurm_env, jobs):
    """The sbatch file of a %%ddp --export cell, on two nodes: rank 0 prints the averages
    and writes them beside the job's output."""
    kernel.run("%load_ext nbddp").assert_ok()
    kernel.run(LOGGED_CELL).assert_ok()
    folder = exported.parent / "cell_sbatch"
    job_id = submit(slurm_env, jobs, "--chdir", str(folder), f"--export=ALL,TMPDIR={folder}",
                    str(folder / "steps.sbatch"))
    wait_until(lambda: job_ended(slurm_env, job_id), timeout=180, interval=0.5)
    out = (folder / f"steps-{job_id}.out").read_text()
    assert "cell done on 2 ranks" in out, out + (folder / f"steps-{job_id}.err").read_text()
    assert "[nbddp] step 9: loss=13.5 (mean of 2 ranks)" in out  # (9 * 1 + 9 * 2) / 2
    rows = [json.loads(line) for line in
            (folder / "nbddp-metrics" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": s, "ranks": 2, "loss": s * 1.5} for s in range(10)]
