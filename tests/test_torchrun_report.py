"""``nbddp._torchrun --report FD``, as a Ray node's agent starts it: torchrun goes on in a
process of its own, says its exit code on the report pipe, and its node's run dir is
removed whoever ends first (real torchrun, one rank; no Ray needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from nbddp._wire.rundir import LIFELINE_GO

from .conftest import descendants, wait_until

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


def start_like_an_agent(tmp_path: Path) -> tuple[Path, int, int]:
    """torchrun on a script that returns at once, started as ``NodeAgent.start`` does:
    the run dir, the lifeline's write end and the report's read end."""
    script = tmp_path / "quick.py"
    script.write_text("print('done')\n")
    run_dir = Path(tempfile.mkdtemp(prefix="nbddp-ray-"))
    read_end, lifeline = os.pipe()
    report, report_write = os.pipe()
    starter = subprocess.Popen(
        [sys.executable, "-m", "nbddp._torchrun", str(run_dir), str(read_end), "--report",
         str(report_write), "--standalone", "--nnodes", "1", "--nproc-per-node", "1",
         str(script)],
        pass_fds=(read_end, report_write), start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(read_end)
    os.close(report_write)
    starter.wait()  # it went on in a child of its own
    os.write(lifeline, LIFELINE_GO)
    return run_dir, lifeline, report


def read_report(fd: int) -> bytes:
    said = b""
    while chunk := os.read(fd, 64):
        said += chunk
    os.close(fd)
    return said


def test_an_agent_killed_as_torchrun_ends_leaves_no_run_dir(tmp_path):
    """The ranks of a session whose kernel died leave by themselves (they saw it go), and
    Ray kills the agents at the same moment: an agent gone before it cleaned up closes
    torchrun's lifeline, and torchrun, which waited for that, removes the run dir."""
    others = descendants()  # (a test module's Ray cluster, say: not this test's)
    run_dir, lifeline, report = start_like_an_agent(tmp_path)
    assert read_report(report) == b"0"
    assert run_dir.exists()  # torchrun waits for its agent to read its log and clean up
    os.close(lifeline)  # the agent dies without cleaning up
    wait_until(lambda: not run_dir.exists() and not descendants() - others, timeout=30)


def test_an_agent_that_cleans_up_lets_torchrun_go(tmp_path):
    others = descendants()
    run_dir, lifeline, report = start_like_an_agent(tmp_path)
    assert read_report(report) == b"0"
    assert descendants() - others  # still there, waiting for the agent
    shutil.rmtree(run_dir)  # the agent's clean-up: it removes the run dir, then lets go
    os.close(lifeline)
    wait_until(lambda: not descendants() - others, timeout=30)
