"""``nbddp._torchrun``'s lifeline, as a local group's torchrun holds it: a kernel that
dies at any moment leaves no run dir (real torchrun, one rank; no kernel needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from nbddp._wire.rundir import LIFELINE_GO

from .conftest import wait_until

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast

UNTIL_TOLD = """
import os, sys, time
open(sys.argv[1], "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.001)
"""


def test_a_kernel_that_dies_as_its_ranks_end_leaves_no_run_dir(tmp_path):
    """Ranks whose kernel dies leave by themselves (they lose its channel), so torchrun
    ends while its lifeline's watcher removes the run dir: torchrun removes it too, and
    does not end with it half removed (a watcher that dies with its process did so,
    once). The run dir holds many files here, so that its removal takes a while."""
    script, started, told = tmp_path / "rank.py", tmp_path / "started", tmp_path / "told"
    script.write_text(UNTIL_TOLD)
    run_dir = Path(tempfile.mkdtemp(prefix="nbddp-lifeline-"))
    try:
        bulk = run_dir / "bulk"
        bulk.mkdir()
        for number in range(30_000):
            (bulk / str(number)).touch()
        read_end, lifeline = os.pipe()
        torchrun = subprocess.Popen(
            [sys.executable, "-m", "nbddp._torchrun", str(run_dir), str(read_end),
             "--standalone", "--nnodes", "1", "--nproc-per-node", "1", "--monitor-interval",
             "0.01", str(script), str(started), str(told)],
            pass_fds=(read_end,), start_new_session=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(read_end)
        try:
            os.write(lifeline, LIFELINE_GO)
            wait_until(started.exists, timeout=60)
            os.close(lifeline)  # the kernel dies ...
            told.touch()  # ... and its rank leaves
            torchrun.wait(timeout=60)  # (0, or 1 where its watcher's stop came first)
        finally:
            torchrun.kill()
            torchrun.wait()
        assert not run_dir.exists(), f"left: {sorted(p.name for p in run_dir.iterdir())[:5]}"
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
