"""The live panel as a notebook stores it: widget state after a real run (nbclient)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import nbformat
import pytest
from nbclient import NotebookClient

from .kernel_driver import Kernel

WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
SVG = "{http://www.w3.org/2000/svg}"

TRAIN = '''
import nbddp

def train(steps):
    import time
    import torch.distributed as dist
    rank = dist.get_rank()
    for step in nbddp.progress(range(steps), desc="train"):
        nbddp.log(step=step, loss=step + 10 * rank, acc=0.5 + rank)
        time.sleep(0.01)
    return "trained"

nbddp.launch(train, nprocs=2, args=(30,))
'''

FAIL = '''
def fails(steps):
    import torch.distributed as dist
    for step in nbddp.progress(range(steps)):
        nbddp.log(step=step, loss=1.0)
        if dist.get_rank() == 1 and step == 5:
            raise RuntimeError("diverged")

nbddp.launch(fails, nprocs=2, args=(100,))
'''

SLOW_LOADER = '''
def slow_loader(steps):
    import time
    import torch
    import torch.distributed as dist
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def batches():  # rank 1's loader takes 60 ms a batch
        for _ in range(steps):
            if dist.get_rank() == 1:
                time.sleep(0.06)
            yield torch.randn(32, 64)

    for x in nbddp.progress(batches(), total=steps):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.01)

job = nbddp.launch(slow_loader, nprocs=2, args=(60,), wait=False)
job.result()
split = job.ranks[1]["step_split"]
print("rank 1 waits for data:", split["data"] > 0.5, "rank 0 in collectives:",
      job.ranks[0]["step_split"]["collectives"] > 0.4)
'''


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """A notebook with a training cell and a failing cell, run with widget state kept."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(TRAIN), nbformat.v4.new_code_cell(FAIL),
                nbformat.v4.new_code_cell(SLOW_LOADER)]
    NotebookClient(nb, timeout=180, kernel_name="python3", allow_errors=True,
                   store_widget_state=True,
                   resources={"metadata": {"path": str(tmp_path_factory.mktemp("nb"))}}
                   ).execute()
    return nb


def panel(nb, cell_index):
    """The widget models of the panel shown under one cell, by class name."""
    state = nb.metadata["widgets"][WIDGET_STATE]["state"]
    (shown,) = [o for o in nb.cells[cell_index].outputs if o.output_type == "display_data"
                and "application/vnd.jupyter.widget-view+json" in o.data]
    models: dict[str, list[dict]] = {}

    def walk(model_id):
        model = state[model_id]
        models.setdefault(model["model_name"], []).append(model["state"])
        for child in model["state"].get("children", []):
            walk(child.removeprefix("IPY_MODEL_"))

    walk(shown.data["application/vnd.jupyter.widget-view+json"]["model_id"])
    return models


def chart_texts(models) -> dict[str, list[str]]:
    """Per chart (by title), the words it shows; each chart has a line per metric."""
    (charts,) = [m["value"] for m in models["HTMLModel"]
                 if m["value"].startswith('<div class="nbddp-charts"')]
    shown = {}
    for svg in ET.fromstring(charts):
        assert svg.get("class") == "nbddp-chart"
        lines = svg.findall(f"{SVG}polyline")
        assert [line.get("data-metric") for line in lines] == svg.get("data-metrics").split()
        assert all(len(line.get("points").split()) == 30 for line in lines)
        shown[svg.get("data-chart")] = ["".join(t.itertext()) for t in svg.iter(f"{SVG}text")]
    return shown


def test_a_finished_run_shows_the_final_step_and_rank_averages(executed):
    models = panel(executed, 0)
    (bar,) = models["IntProgressModel"]
    assert (bar["value"], bar["max"], bar["bar_style"]) == (30, 30, "success")
    html = " ".join(m["value"] for m in models["HTMLModel"])
    assert "nbddp: finished" in html
    assert "step 29 (mean of 2 ranks)" in html
    # Each rank's line ends where the rank ended, not at its last sample before:
    assert "0 finished (step 29" in html and "1 finished (step 29" in html, html
    assert "<b>loss</b> 34" in html  # mean of 29 and 29 + 10
    assert "<b>acc</b> 1" in html  # mean of 0.5 and 1.5
    charts = chart_texts(models)
    assert charts["loss"][:2] == ["loss", "0"] and "step" in charts["loss"]  # title, axes
    assert "loss 34 min 5 @ 0" in charts["loss"]  # latest and best, in the legend
    assert "acc 1 max 1 @ 0" in charts["acc"]
    assert "30/30" in html
    stream = "".join(o.get("text", "") for o in executed.cells[0].outputs)
    assert "nbddp: finished on 2 ranks" in stream  # a record that needs no widgets
    # Where widgets cannot render (this headless run), the panel reads as text:
    (shown,) = [o for o in executed.cells[0].outputs if o.output_type == "display_data"]
    text = shown.data["text/plain"]
    assert "nbddp: finished (ranks: 0 finished, 1 finished)" in text
    assert "100%" in text and "30/30" in text
    assert "step 29 (mean of 2 ranks): loss=34 acc=1" in text
    assert "best: loss min 5 @ 0, acc max 1 @ 0" in text


def test_a_failed_run_turns_the_panel_red_and_names_the_rank(executed):
    models = panel(executed, 1)
    (bar,) = models["IntProgressModel"]
    assert bar["bar_style"] == "danger"
    html = " ".join(m["value"] for m in models["HTMLModel"])
    assert "nbddp: failed" in html
    assert "rank 1 raised RuntimeError: diverged" in html
    assert "1 failed (step 5" in html, html  # where it ended: its report's own stats
    assert "0 stopped" in html, html  # nbddp stopped it: it did not fail
    (error,) = [o for o in executed.cells[1].outputs if o.output_type == "error"]
    assert error.ename == "WorkerError"
    (shown,) = [o for o in executed.cells[1].outputs if o.output_type == "display_data"]
    assert "nbddp: failed" in shown.data["text/plain"]
    assert "1 failed" in shown.data["text/plain"]


def test_a_loader_that_sleeps_on_one_rank_shows_as_that_ranks_wait_for_data(executed):
    models = panel(executed, 2)
    html = " ".join(m["value"] for m in models["HTMLModel"])
    verdict = re.search(r"slowest: rank (\d): (\d+)% of its step waiting for data", html)
    assert verdict, html
    assert verdict[1] == "1" and int(verdict[2]) >= 50
    assert html.count('class="nbddp-split"') == 2  # a bar beside each rank
    stream = "".join(o.get("text", "") for o in executed.cells[2].outputs)
    assert "rank 1 waits for data: True rank 0 in collectives: True" in stream
    (shown,) = [o for o in executed.cells[2].outputs if o.output_type == "display_data"]
    text = shown.data["text/plain"]  # the same, as the saved notebook reads
    assert re.search(r"time per step: rank 0: data \d+% compute \d+% collectives \d+%", text)
    assert "slowest: rank 1:" in text


def test_a_loop_without_ddp_is_split_into_data_and_compute_only(executed):
    (shown,) = [o for o in executed.cells[0].outputs if o.output_type == "display_data"]
    line = next(line for line in shown.data["text/plain"].splitlines()
                if line.startswith("time per step: "))
    assert re.fullmatch(r"time per step: rank 0: data \d+% compute \d+% \([\d.]+ ms/step\); "
                        r"rank 1: data \d+% compute \d+% \([\d.]+ ms/step\); "
                        r"slowest: rank \d: \d+% of its step computing", line), line


# --- where widgets show: any shell that is ipykernel's, whatever its class is called ----

CHOOSES = """
import sys
from nbddp._panel.frontend import make_panel

def chosen():
    return type(make_panel()).__name__

print("plain", chosen(), "ipykernel" in sys.modules)
from IPython.terminal.interactiveshell import TerminalInteractiveShell
TerminalInteractiveShell.instance()
print("terminal", chosen(), "ipykernel" in sys.modules)
TerminalInteractiveShell.clear_instance()
from ipykernel.zmqshell import ZMQInteractiveShell

class Shell(ZMQInteractiveShell):  # as Colab's google.colab._shell.Shell
    pass

Shell.instance()
print("subclass", chosen())
"""


@pytest.mark.fast
def test_the_panel_is_widgets_where_the_shell_is_ipykernels_or_a_subclass(tmp_path):
    """A plain process and IPython in a terminal get text (and never import ipykernel);
    a shell that subclasses ipykernel's under another name gets widgets."""
    env = {**os.environ, "IPYTHONDIR": str(tmp_path)}
    env.pop("NBDDP_DISPLAY", None)
    done = subprocess.run([sys.executable, "-c", CHOOSES], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["plain TextPanel False", "terminal TextPanel False",
                                        "subclass WidgetPanel"], done.stdout + done.stderr


COLAB_LIKE = """
from ipykernel.ipkernel import IPythonKernel
from ipykernel.zmqshell import ZMQInteractiveShell
from traitlets import Type


class Shell(ZMQInteractiveShell):
    \"\"\"A shell of another name, as Colab's, Kaggle's or VS Code's kernels run.\"\"\"


class Kernel(IPythonKernel):
    shell_class = Type(Shell)
"""


def test_a_kernel_whose_shell_subclasses_ipykernels_shows_the_widget_panel(tmp_path):
    """The way Colab runs its kernel: ipykernel with a shell class of its own."""
    (tmp_path / "colab_like.py").write_text(textwrap.dedent(COLAB_LIKE))
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    kernel = Kernel(tmp_path, ["--IPKernelApp.kernel_class=colab_like.Kernel"],
                    {**os.environ, "PYTHONPATH": path})
    try:
        shell = kernel.run("type(get_ipython()).__name__").assert_ok()
        assert shell.result() == "'Shell'", shell.describe()
        run = kernel.run("""
            import nbddp

            def train():
                for step in nbddp.progress(range(3)):
                    nbddp.log(step=step, loss=1.0 / (step + 1))
                return "trained"

            nbddp.launch(train, nprocs=2)
        """).assert_ok()
        assert run.result() == "'trained'", run.describe()
        widgets = [o for o in run.outputs if o.msg_type == "display_data"
                   and "application/vnd.jupyter.widget-view+json" in o.content["data"]]
        assert widgets, f"no widget panel, only text:\n{run.describe()}"
    finally:
        kernel.shutdown()
