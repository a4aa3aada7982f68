"""Shared fixtures. Every test is checked for leftovers: processes, run dirs, sockets.

pytest makes itself a child subreaper, so ranks orphaned by a dead torchrun or kernel
stay our descendants and cannot escape the check. A test that leaves any descendant
process, nbddp run directory or open socket behind fails, and what it left is stopped
by PID.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import NoReturn

import pytest

from .suite_time import SuiteTime

_PR_SET_CHILD_SUBREAPER = 36


def pytest_configure(config):
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    config.pluginmanager.register(SuiteTime(), "nbddp-suite-time")
    # The tests that press Ctrl-C need Python's SIGINT handler, as a kernel has it; a
    # suite started in the background by a shell without job control inherits SIGINT
    # ignored, and Python then leaves it ignored.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # A stop (SIGTERM, as a shell's kill of the lanes' process group sends it) ends the
    # suite as Ctrl-C does, so pytest_unconfigure still removes the lane's folders (two
    # empty lane folders were left in /dev/shm by a suite stopped so).
    signal.signal(signal.SIGTERM, _stopped)
    # Runs (and kernels started by tests) put their run dirs in a temp dir of our own,
    # so the leftover check sees this session's files only.
    session_tmp = tempfile.mkdtemp(prefix="pytest-nbddp-")
    os.environ["TMPDIR"] = tempfile.tempdir = session_tmp
    os.environ["NBDDP_RUNS_DIR"] = os.path.join(session_tmp, "records")
    # Standby ranks would outlive each test that launches (and every kernel the tests
    # start inherits this); the tests of standby ranks turn them on themselves.
    os.environ["NBDDP_STANDBY"] = "0"


def _stopped(signum, frame):
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def pytest_unconfigure(config):
    shutil.rmtree(os.environ["TMPDIR"], ignore_errors=True)
    if LANE_SHM is not None:
        shutil.rmtree(LANE_SHM, ignore_errors=True)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        tree.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    return tree


def _state(pid: int) -> str | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2]


def descendants(root: int | None = None) -> set[int]:
    """Live (non-zombie) descendant processes of ``root`` (default: this process)."""
    tree, found, todo = _children(), set(), [root or os.getpid()]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    zombies = {pid for pid in found if _state(pid) in (None, "Z", "X")}
    for pid in zombies:  # orphans adopted by pytest (the subreaper) are reaped here
        if pid in tree.get(os.getpid(), []):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
    return found - zombies


# --- what a run may not skip: its clusters and tools ---------------------------------

REQUIRED = frozenset(filter(None, os.environ.get("NBDDP_REQUIRE", "").split(",")))
"""The clusters and tools this run must have (of ``ray``, ``slurm``, ``browser``):
scripts/test.sh's full run, CI's, names all three, so a test that would skip for want of
one (the ``ray`` command not on PATH, the SLURM cluster dead mid-suite) fails instead,
with the reason, and the run is not green with a lane of it unrun. GPU tests still skip."""


def missing(need: str, reason: str) -> NoReturn:
    """Skip the test for want of ``need``: fail it where this run requires ``need``."""
    if need in REQUIRED:
        pytest.fail(f"this run requires {need} (NBDDP_REQUIRE), and it is missing: {reason}",
                    pytrace=False)
    pytest.skip(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test marked with a required cluster or tool that skipped anyway (a ``skipif``, a
    skip of its own) is reported failed, with the reason it gave; unless it is a GPU test
    (a Ray test on GPUs skips where there are none, as every GPU test does)."""
    report = (yield).get_result()
    needs = sorted(name for name in REQUIRED if item.get_closest_marker(name))
    gpu = item.get_closest_marker("gpu") is not None  # (skips without a GPU, always)
    if report.skipped and needs and not gpu and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (f"this run requires {', '.join(needs)} (NBDDP_REQUIRE), "
                           f"so this test may not skip: {reason}")


# --- lanes: the whole suite runs as two pytest processes at once (scripts/test.sh) ----

LANE = os.environ.get("NBDDP_TEST_LANE", "")
"""``waiting`` or ``busy``: this process runs only that lane's tests; unset: all."""


def lane_of(item: pytest.Item) -> str:
    """Tests marked ``waits`` spend much of their time waiting (on SLURM's scheduler, a
    timeout, a silent rank, a kernel): on a 2-core machine they run beside the rest, which
    keep both cores busy, and the suite takes about two thirds of the time. Every other
    test runs in the ``busy`` lane; together the lanes run every test once."""
    return "waiting" if item.get_closest_marker("waits") else "busy"


def notebook_marks(item: pytest.Item) -> tuple[str, ...]:
    """The marks a notebook asks for in its metadata (``"nbddp_test": {"marks": [...]}``):
    nbval's cells carry no decorators, so a notebook that needs a cluster says so there."""
    return _notebook_marks(item.path) if item.path.suffix == ".ipynb" else ()


@functools.cache
def _notebook_marks(path: Path) -> tuple[str, ...]:
    metadata = json.loads(path.read_text()).get("metadata", {})
    return tuple(metadata.get("nbddp_test", {}).get("marks", []))


def pytest_collection_modifyitems(config, items):
    for item in items:
        for mark in notebook_marks(item):
            item.add_marker(mark)
    if not LANE:
        return
    if LANE not in ("waiting", "busy"):
        raise pytest.UsageError(f"NBDDP_TEST_LANE is 'waiting' or 'busy', not {LANE!r}")
    mine, others = [], []
    for item in items:
        (mine if lane_of(item) == LANE else others).append(item)
    config.hook.pytest_deselected(items=others)
    items[:] = mine


LANE_SHM: str | None = None
"""The shared-memory folder this pytest made for itself (removed at the end), if any."""
if "NBDDP_SHM_DIR" not in os.environ and os.path.isdir("/dev/shm"):
    # Each pytest (each lane) its own shared-memory folder, so that none counts another's
    # data files as its leftovers, and removes them (kernels and ranks inherit it): a
    # test run while the suite ran once removed a 5 GB result the suite was reading.
    LANE_SHM = os.environ["NBDDP_SHM_DIR"] = tempfile.mkdtemp(
        prefix=f"pytest-nbddp-{LANE or 'all'}-", dir="/dev/shm")

SHM = os.environ.get("NBDDP_SHM_DIR") or "/dev/shm"
"""Where data files go (and are checked for leftovers): ``NBDDP_SHM_DIR`` moves both."""


def run_dirs() -> set[str]:
    """nbddp run dirs, and torchrun's own log dirs, in this session's temp dir; and the
    run dirs' twins in shared memory (data files)."""
    return {path for folder, pattern in ((tempfile.gettempdir(), "nbddp-*"),
                                         (tempfile.gettempdir(), "torchelastic_*"),
                                         (SHM, "nbddp-*"))
            for path in glob.glob(os.path.join(folder, pattern))}


def contents(folder: str) -> list[str]:
    """What ``folder`` holds, at any depth: each file's path in it, size and age (s), and
    each folder's (ending in ``/``: who made an empty one says who made the tree)."""
    now, found = time.time(), []
    for parent, subfolders, files in os.walk(folder):
        for name in subfolders:
            found.append(os.path.relpath(os.path.join(parent, name), folder) + "/")
        for name in files:
            path = os.path.join(parent, name)
            with contextlib.suppress(OSError):
                stat = os.lstat(path)
                found.append(f"{os.path.relpath(path, folder)} ({stat.st_size} B, "
                             f"{now - stat.st_mtime:.0f} s old)")
    return found


def local_run_dirs() -> set[str]:
    """The run dirs themselves (in this session's temp dir), without their twins."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "nbddp-*")))


def socket_fds() -> set[str]:
    fds = set()
    for fd in glob.glob("/proc/self/fd/*"):
        try:
            if os.readlink(fd).startswith("socket:"):
                fds.add(fd)
        except OSError:
            continue
    return fds


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"


def rays_own(pid: int) -> bool:
    """A process a Ray test cluster keeps for itself (an idle worker of its pool), which
    it starts whenever it likes: not one nbddp started (its agents and their torchruns
    are checked as any other process)."""
    return cmdline(pid).startswith("ray::IDLE")


LEFTOVER_GRACE = 30.0


@pytest.fixture(autouse=True)
def no_interrupt_hold_left():
    """Fail the test if it leaves Ctrl-C held: a hold inside one in force holds nothing
    itself, so one never released would leave every later start unheld."""
    yield
    from nbddp._run.interrupt_hold import InterruptHold  # (nbddp is imported after the setup)

    left = InterruptHold._current
    if left is not None:
        left.restore()  # (Ctrl-C raises again for the next test)
    assert left is None, "an interrupt hold was left in force"


@pytest.fixture(autouse=True)
def no_leftovers():
    """Fail the test if it leaves a process, a run dir or a socket behind.

    A run whose ranks all returned gives its value back while its processes are still
    exiting, so they get ``LEFTOVER_GRACE`` seconds to be gone before they count (ranks
    that held a 500 MB payload, beside the other lane, took more than 15 s once)."""
    before_procs, before_dirs, before_socks = descendants(), run_dirs(), socket_fds()
    yield

    def leftovers() -> tuple[set, set, set]:
        return ({pid for pid in descendants() - before_procs if not rays_own(pid)},
                run_dirs() - before_dirs, socket_fds() - before_socks)

    deadline = time.monotonic() + LEFTOVER_GRACE
    found = leftovers()
    while any(found) and time.monotonic() < deadline:
        time.sleep(0.05)
        found = leftovers()
    left, dirs, socks = found  # (what ended the wait: a module kernel's next squeue,
    # started a moment later, is no leftover)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    held = {path: contents(path) for path in dirs}  # (what is in them says who made them)
    for path in dirs:  # (reported below; gone, with the processes that would have removed
        shutil.rmtree(path, ignore_errors=True)  # them, so the next test starts clean)
    assert not left, "processes left behind: " + "; ".join(cmdline(p) for p in left)
    assert not dirs, f"run directories left behind: {held}"
    assert not socks, f"sockets left open: {len(socks)}"


@pytest.fixture
def standby_on():
    """Standby ranks in this process, stopped again (and checked gone) after the test."""
    import nbddp

    nbddp.standby(True)
    try:
        yield
    finally:
        nbddp.standby(False)


def wait_until(condition, timeout: float = 30.0, interval: float = 0.05):
    """Poll ``condition`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s: {condition}")


# --- real Jupyter kernels -------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def _jupyter_event_loop():
    """jupyter_client's sync API keeps one asyncio loop (a socket pair) per thread;
    create it before the per-test leftover check, which would count it as a leak."""
    from jupyter_core.utils import ensure_event_loop

    ensure_event_loop()


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """One kernel per test module, for tests that neither interrupt nor kill it."""
    from .kernel_driver import Kernel

    k = Kernel(tmp_path_factory.mktemp("kernel"))
    try:
        k.run("import nbddp").assert_ok()
        yield k
    finally:
        k.shutdown()


@pytest.fixture
def fresh_kernel(tmp_path):
    """A kernel of the test's own, for tests that interrupt or kill it."""
    from .kernel_driver import Kernel

    k = Kernel(tmp_path)
    try:
        yield k
    finally:
        k.shutdown()


# --- the SLURM test cluster -----------------------------------------------------------


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    """The environment for SLURM commands; skips the test where no cluster is up."""
    from .slurm import load_env, unavailable

    reason = unavailable()
    if reason:
        missing("slurm", reason)
    return {**os.environ, **load_env()}


@pytest.fixture
def jobs(slurm_env):
    """Job ids a test submits; any still queued at the end are cancelled, and waited for."""
    from .slurm import job_ended, slurm

    submitted: list[str] = []
    yield submitted
    for job_id in submitted:
        if not job_ended(slurm_env, job_id):
            slurm(slurm_env, "scancel", job_id)
    for job_id in submitted:
        wait_until(lambda job_id=job_id: job_ended(slurm_env, job_id), timeout=60, interval=0.2)
