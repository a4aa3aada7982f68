"""Processes by PID: whether one still runs code (pure logic over /proc, real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from nbddp._local.launcher import ProcessWatch

from .conftest import wait_until

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


def stopping(pid: int) -> bool:
    """A one-off look, by a watch of its own (it opens the process's files afresh)."""
    watch = ProcessWatch()
    try:
        return watch.stopping(pid)
    finally:
        watch.close()


def test_stopping_tells_a_live_process_from_a_killed_one():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not stopping(child.pid) and not stopping(os.getpid())
        os.kill(child.pid, signal.SIGSTOP)  # stopped is not stopping: it may go on
        assert not stopping(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        assert stopping(child.pid)  # at once: SIGKILL pending, exiting, or a zombie
        wait_until(lambda: child.poll() is not None)
    finally:
        child.kill()
        child.wait()
    assert stopping(child.pid)  # reaped: gone


def test_a_watch_keeps_each_process_s_stat_open_and_sees_it_killed_and_reaped():
    """The hand-over's watch reads a file it keeps open: a kill shows at once, and once
    the process is reaped the watch says so (its file is that process's, not the PID's)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = ProcessWatch()
    try:
        assert not watch.stopping(child.pid) and not watch.stopping(os.getpid())
        os.kill(child.pid, signal.SIGKILL)
        assert watch.stopping(child.pid)
        wait_until(lambda: child.poll() is not None)
        assert watch.stopping(child.pid)
    finally:
        child.kill()
        child.wait()
        watch.close()
    assert watch.stopping(os.getpid())  # closed (its group is): it opens nothing again


def test_a_process_that_has_just_taken_its_kill_is_stopping():
    """A killed process takes its SIGKILL a few microseconds before it is marked exiting,
    and ``stat`` shows neither meanwhile: looked at right after each of many kills, the
    watch must never say such a process goes on (before, about one look in a hundred
    did)."""
    missed = 0
    for _ in range(100):
        child = subprocess.Popen(["sleep", "60"])
        watch = ProcessWatch()
        try:
            assert not watch.stopping(child.pid)
            os.kill(child.pid, signal.SIGKILL)
            missed += not watch.stopping(child.pid)
        finally:
            child.kill()
            child.wait()
            watch.close()
    assert missed == 0
