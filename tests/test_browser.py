"""A real browser: JupyterLab in headless Chromium runs an nbddp cell; the live panel is
checked as a person sees it (header, progress bar, metrics table, chart with axes).

Needs Debian's chromium at /usr/bin/chromium and the Python packages ``jupyterlab`` and
``playwright`` (``bash scripts/install-browser.sh``); skipped where any is missing.
Playwright drives the system Chromium, so ``playwright install`` is never needed.
Set ``NBDDP_SAVE_SCREENSHOT=1`` to keep the screenshot at ``tests/artifacts/panel.png``
(``failure.png`` there too when the test fails); otherwise it stays in ``tmp_path``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import site
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import descendants, rays_own
from .test_ray_session import ray_cluster as ray_cluster  # noqa: F401 - a fixture

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACT = Path(__file__).parent / "artifacts" / "panel.png"
SERVER_START_TIMEOUT = 90.0
KERNEL_READY_TIMEOUT = 90.0
RUN_TIMEOUT = 120.0  # the cell: kernel imports nbddp, torchrun starts 2 ranks, 40 steps


def _missing() -> str:
    missing = [] if os.access(CHROMIUM, os.X_OK) else [str(CHROMIUM)]
    missing += [name for name in ("playwright", "jupyterlab")
                if importlib.util.find_spec(name) is None]
    return ", ".join(missing)


pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(bool(_missing()), reason=f"the browser test needs {_missing()} "
                       "(install with: bash scripts/install-browser.sh)"),
]

TRAIN = """\
import nbddp, time
def train(steps):
    import torch.distributed as dist
    for step in nbddp.progress(range(steps), desc="train"):
        nbddp.log(step=step, loss=1.0 / (step + 1) + dist.get_rank())
        time.sleep(0.05)
    return "done"
"""
LOCAL = TRAIN + "nbddp.launch(train, nprocs=2, args=(40,))"
"""Two ranks on this machine."""


def on_ray(address: str) -> str:
    """The same run on a two-node Ray cluster: one rank on each node."""
    return (f"import os\nos.environ['RAY_ADDRESS'] = {address!r}\n" + TRAIN
            + "nbddp.launch(train, nprocs=1, args=(40,), cluster=nbddp.Ray(nodes=2))")


def _notebook(source: str) -> dict:
    return {
        "cells": [{"cell_type": "code", "execution_count": None, "id": "nbddp-browser",
                   "metadata": {}, "outputs": [], "source": source}],
        "metadata": {
            "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                           "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


# --- JupyterLab server ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _isolated_env(tmp: Path) -> dict[str, str]:
    """The environment for JupyterLab and Chromium: every settings dir inside ``tmp``."""
    dirs = {name: tmp / sub for name, sub in [
        ("HOME", "home"), ("JUPYTER_CONFIG_DIR", "jupyter/config"),
        ("JUPYTER_DATA_DIR", "jupyter/data"), ("JUPYTER_RUNTIME_DIR", "jupyter/runtime"),
        ("JUPYTERLAB_SETTINGS_DIR", "jupyter/lab/user-settings"),
        ("JUPYTERLAB_WORKSPACES_DIR", "jupyter/lab/workspaces"),
        ("IPYTHONDIR", "ipython"), ("XDG_CONFIG_HOME", "xdg/config"),
        ("XDG_CACHE_HOME", "xdg/cache"), ("XDG_DATA_HOME", "xdg/data"),
    ]}
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **{name: str(path) for name, path in dirs.items()})
    env.setdefault("PYTHONUSERBASE", site.getuserbase())  # a --user install still imports
    env.pop("NBDDP_DISPLAY", None)  # the kernel must choose the widget panel by itself
    # No news or update checks (network, and a toast over the notebook).
    notification = dirs["JUPYTERLAB_SETTINGS_DIR"] / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True)
    (notification / "notification.jupyterlab-settings").write_text(
        json.dumps({"checkForUpdates": False, "fetchNews": "false"}))
    return env


def _api(base: str, token: str, method: str, path: str, timeout: float = 10.0):
    request = urllib.request.Request(base + path, method=method,
                                     headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read()
    return json.loads(body) if body else None


class JupyterLab:
    """``jupyter lab`` in a process group of its own, serving ``root``."""

    def __init__(self, tmp: Path) -> None:
        self.root = tmp / "notebooks"
        self.root.mkdir()
        self.env = _isolated_env(tmp)
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "jupyterlab.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "jupyter", "lab", "--no-browser",
                 "--ip", "127.0.0.1", "--port", str(self.port),
                 f"--ServerApp.token={self.token}", f"--ServerApp.root_dir={self.root}",
                 "--ServerApp.port_retries=0", "--ServerApp.terminals_enabled=False",
                 "--LabApp.extension_manager=readonly",
                 "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                 "--LabApp.news_url=None",
                 *(["--allow-root"] if os.geteuid() == 0 else [])],
                cwd=self.root, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def api(self, method: str, path: str):
        return _api(self.base, self.token, method, path)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"jupyter lab exited with {self.process.returncode}:\n"
                                     + self.log())
            with contextlib.suppress(OSError):
                self.api("GET", "/api/status")
                return
            time.sleep(0.2)
        raise AssertionError(f"jupyter lab not serving within {SERVER_START_TIMEOUT} s:\n"
                             + self.log())

    def stop(self) -> None:
        """Shut every kernel down through the REST API, then stop the server's group."""
        try:
            if self.process.poll() is None:
                with contextlib.suppress(OSError, ValueError):
                    for kernel in self.api("GET", "/api/kernels"):
                        with contextlib.suppress(OSError):
                            self.api("DELETE", f"/api/kernels/{kernel['id']}")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@pytest.fixture
def jupyter_lab(tmp_path):
    before = descendants()
    lab = JupyterLab(tmp_path)
    try:
        lab.wait_ready()
        yield lab
    finally:
        lab.stop()
        # Kernels live in sessions of their own: give them a moment to exit, then let
        # the leftover check report (and stop) anything still running.
        deadline = time.monotonic() + 30
        while ({pid for pid in descendants() - before if not rays_own(pid)}
               and time.monotonic() < deadline):
            time.sleep(0.1)


# --- the browser ------------------------------------------------------------------------


class KernelSockets:
    """The page's websockets to /api/kernels/ and how many frames each has received."""

    def __init__(self, page) -> None:
        self.frames: dict = {}
        page.on("websocket", self._opened)

    def _opened(self, ws) -> None:
        if "/api/kernels/" in ws.url:
            self.frames[ws] = 0
            ws.on("framereceived", lambda _payload: self._received(ws))

    def _received(self, ws) -> None:
        self.frames[ws] += 1

    def connected(self) -> bool:
        """A kernel websocket is open and the kernel has answered on it."""
        return any(not ws.is_closed() and count > 0 for ws, count in self.frames.items())

    def describe(self) -> str:
        return "; ".join(f"{ws.url.split('?')[0]} closed={ws.is_closed()} frames={n}"
                         for ws, n in self.frames.items()) or "none opened"


@pytest.fixture
def browser(tmp_path):
    from playwright.sync_api import sync_playwright

    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    env = dict(os.environ, HOME=str(tmp_path / "browser-home"),
               XDG_CONFIG_HOME=str(tmp_path / "browser-home" / ".config"),
               XDG_CACHE_HOME=str(tmp_path / "browser-home" / ".cache"))
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            user_data_dir=str(profile), executable_path=str(CHROMIUM), headless=True,
            args=CHROMIUM_ARGS, env=env, viewport={"width": 1280, "height": 900})
        try:
            yield context
        finally:
            context.close()


def _screenshot(target, tmp_path: Path, name: str = "panel.png") -> Path:
    path = tmp_path / name
    target.screenshot(path=str(path))
    if os.environ.get("NBDDP_SAVE_SCREENSHOT"):
        ARTIFACT.parent.mkdir(exist_ok=True)
        shutil.copyfile(path, ARTIFACT.with_name(name))
    return path


# --- the test ---------------------------------------------------------------------------


def run_in_jupyterlab(jupyter_lab, browser, tmp_path, source: str,
                      ended: str = "nbddp: finished"):
    """Open a notebook of one cell, ``source``, in JupyterLab, run it with Shift+Enter and
    wait until its panel says the run ``ended`` so: the cell and its panel."""
    from playwright.sync_api import expect

    (jupyter_lab.root / "train.ipynb").write_text(json.dumps(_notebook(source)))
    page = browser.pages[0] if browser.pages else browser.new_page()
    sockets = KernelSockets(page)
    page.goto(f"{jupyter_lab.base}/lab/tree/train.ipynb?token={jupyter_lab.token}")

    def fail(what: str) -> None:
        shot = _screenshot(page, tmp_path, "failure.png")
        kernels: object = "?"
        with contextlib.suppress(OSError, ValueError):
            kernels = [(k["execution_state"], k["connections"])
                       for k in jupyter_lab.api("GET", "/api/kernels")]
        pytest.fail(f"{what}\nkernel websockets: {sockets.describe()}\nkernels: {kernels}\n"
                    f"screenshot: {shot}\njupyter lab log:\n{jupyter_lab.log()}")

    # Before its kernel is connected, JupyterLab shows "idle" yet drops a Shift+Enter:
    # wait until a kernel websocket is open and the kernel has spoken on it.
    cell = page.locator(".jp-Notebook .jp-CodeCell").first
    try:
        expect(cell).to_be_visible(timeout=KERNEL_READY_TIMEOUT * 1000)
        deadline = time.monotonic() + KERNEL_READY_TIMEOUT
        while not sockets.connected():
            if time.monotonic() > deadline:
                raise TimeoutError("no kernel websocket")
            page.wait_for_timeout(100)
        expect(page.locator(".jp-Notebook-ExecutionIndicator")).to_have_attribute(
            "data-status", "idle", timeout=KERNEL_READY_TIMEOUT * 1000)
    except (AssertionError, TimeoutError) as exc:
        fail(f"the notebook's kernel did not connect within {KERNEL_READY_TIMEOUT} s: {exc}")

    cell.locator(".jp-InputArea-editor .cm-content").click()
    page.keyboard.press("Shift+Enter")
    try:
        expect(cell.locator(".jp-InputPrompt")).not_to_have_text(re.compile(r"^\s*\[\s*\]"),
                                                                 timeout=15_000)
    except AssertionError:
        fail("Shift+Enter did not start the cell")

    # The live panel: an ipywidgets VBox rendered in the cell's output area.
    panel = cell.locator(".jp-OutputArea-output .widget-vbox").first
    header = panel.locator(".widget-html-content").first
    try:
        expect(header).to_contain_text(ended, timeout=RUN_TIMEOUT * 1000)
        expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\s*1\s*\]"),
                                                             timeout=30_000)
    except AssertionError as exc:
        outputs = cell.locator(".jp-OutputArea").inner_text()
        fail(f"the panel did not show {ended!r} within {RUN_TIMEOUT} s: {exc}\n"
             f"cell output:\n{outputs}")
    return cell, panel


def check_panel(cell, panel, tmp_path) -> str:
    """What a person checks in the finished panel of ``TRAIN``'s run on two ranks: the
    bar, the rank-averaged metrics, the chart and the cell's value; the panel's text."""
    from playwright.sync_api import expect

    shot = _screenshot(cell, tmp_path)
    text = panel.inner_text()

    # Header: both ranks finished.
    assert re.search(r"0 finished", text) and re.search(r"1 finished", text), text

    # Progress bar full (and green), and its label 40/40.
    bar = panel.locator(".widget-hprogress .progress-bar")
    expect(bar).to_have_count(1)
    expect(bar).to_have_class(re.compile(r"\bprogress-bar-success\b"))
    assert bar.evaluate("el => el.style.width") == "100%", bar.evaluate("el => el.outerHTML")
    track = panel.locator(".widget-hprogress .progress").bounding_box()
    filled = bar.bounding_box()
    assert track and filled and filled["width"] >= track["width"] - 1, (track, filled)
    assert re.search(r"\b40/40\b", text), text

    # The metrics table: the last step's loss, averaged over ranks 0 and 1 (1/40 + r).
    table = panel.locator("table").first
    expect(table).to_be_visible()
    row = table.inner_text()
    assert re.search(r"step 39 \(mean of 2 ranks\)", row), row
    assert re.search(r"\bloss\s+0\.525\b", row), row

    # A chart of the loss: an inline SVG with axes, a line through 40 points, and a
    # legend with the latest and best values.
    chart = panel.locator("svg.nbddp-chart[data-chart='loss']")
    expect(chart).to_be_visible()
    expect(chart.locator("path.nbddp-axes")).to_be_visible()
    polyline = chart.locator("polyline[data-metric='loss']")
    expect(polyline).to_have_count(1)
    points = polyline.get_attribute("points") or ""
    assert len(points.split()) == 40, points
    box = polyline.bounding_box()
    assert box and box["width"] > 100 and box["height"] > 20, box
    words = chart.locator("text").all_text_contents()
    assert {"0", "10", "20", "30", "step"} <= set(words), words  # the step axis
    assert {"0.6", "1", "1.4"} <= set(words), words  # the value axis, 0.525 to 1.5
    assert "loss 0.525 min 0.525 @ 39" in words, words

    # Rank 0's return value is the cell's result.
    expect(cell.locator(".jp-OutputArea-executeResult")).to_contain_text("'done'")
    assert shot.stat().st_size > 0
    return text


def test_live_panel_in_jupyterlab(jupyter_lab, browser, tmp_path):
    text = check_panel(*run_in_jupyterlab(jupyter_lab, browser, tmp_path, LOCAL), tmp_path)
    assert " (on " not in text, "ranks on one machine: no node named"


TIMES_OUT = "import nbddp, time\nnbddp.launch(time.sleep, nprocs=2, args=(120,), timeout=8)"


def test_a_timed_out_runs_panel_says_one_line_and_the_error_the_whole_report(
        jupyter_lab, browser, tmp_path):
    """What a person sees when a run times out: the panel's header one line, the ranks
    ``stopped`` (nbddp stopped them), and where each rank was once, in the error below."""
    from playwright.sync_api import expect

    cell, panel = run_in_jupyterlab(jupyter_lab, browser, tmp_path, TIMES_OUT,
                                    ended="nbddp: timed out")
    header = panel.locator(".widget-html-content").first
    text = header.inner_text()
    assert "the run did not finish within 8 s; every rank was stopped" in text, text
    assert "0 stopped" in text and "1 stopped" in text and "failed" not in text, text
    assert "where each rank was" not in panel.inner_text(), panel.inner_text()
    error = cell.locator(".jp-OutputArea-output[data-mime-type="
                         "'application/vnd.jupyter.stderr']")
    expect(error.first).to_contain_text("TimeoutError")
    outputs = cell.locator(".jp-OutputArea").inner_text()
    assert outputs.count("where each rank was:") == 1, outputs
    assert outputs.count("--- rank 0 ---") == 1, outputs  # its stack, once


@pytest.mark.ray
def test_live_panel_of_a_ray_run_in_jupyterlab(ray_cluster, jupyter_lab, browser, tmp_path):
    """The same panel for a run on two Ray nodes, and each rank's line names its node."""
    cell, panel = run_in_jupyterlab(jupyter_lab, browser, tmp_path,
                                    on_ray(ray_cluster.address))
    text = check_panel(cell, panel, tmp_path)
    nodes = dict(re.findall(r"([01]) finished \(on ([^,)]+)", text))
    assert sorted(nodes) == ["0", "1"] and nodes["0"] != nodes["1"], text
    assert ray_cluster.wait_empty() == {"actors": [], "placement_groups": []}


MANY = """\
import nbddp, time
def train(steps):
    import torch.distributed as dist
    rank = dist.get_rank()
    for step in nbddp.progress(range(steps)):
        nbddp.log(step=step, loss=float(rank))
        time.sleep(0.2 if rank == 13 else 0.1)  # rank 13: the slowest
    return "done"
nbddp.launch(train, nprocs=20, args=(30,))
"""


def test_the_panel_of_many_ranks_counts_them_names_a_few_and_shows_every_one_on_demand(
        jupyter_lab, browser, tmp_path):
    """20 ranks: the header says how many are in each state and names the slowest; the
    "every rank" toggle shows a chip for each, with its note."""
    from playwright.sync_api import expect

    cell, panel = run_in_jupyterlab(jupyter_lab, browser, tmp_path, MANY)
    header = panel.locator(".widget-html-content").first
    text = header.inner_text()
    assert "ranks: 20: 20 finished" in text, text
    assert re.search(r"slowest\s+\S+\s*13 finished \(step 29", text), text
    chips = header.locator("span[title^='rank ']")
    assert chips.count() <= 3, text  # a few named, not twenty chips
    assert re.search(r"\b30/30\b", panel.inner_text()), panel.inner_text()  # the bar, as ever
    toggle = panel.get_by_role("button", name="every rank")
    expect(toggle).to_be_visible()
    toggle.click()
    every = panel.locator("span[title^='rank ']")
    expect(every).to_have_count(chips.count() + 20)
    assert re.search(r"\b7 finished \(step 29", panel.inner_text()), panel.inner_text()
    _screenshot(cell, tmp_path, "many-ranks.png")
    toggle.click()
    expect(every).to_have_count(chips.count())
