"""Processes by PID: whether one still runs code (pure logic over /proc, real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from nbddp._errors import NbddpError
from nbddp._local import cores
from nbddp._local.cores import cpu_quota, usable_cores
from nbddp._local.launcher import LocalLauncher, ProcessWatch
from nbddp._run.groups.shape import GroupShape
from nbddp._wire.rundir import RunDir

from .conftest import wait_until

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


def stopping(pid: int) -> bool:
    """A one-off look, by a watch of its own (it opens the process's files afresh)."""
    watch = ProcessWatch()
    try:
        watch.follow("it", pid)
        return watch.stopping("it")
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
    watch.follow("child", child.pid)
    watch.follow("me", os.getpid())
    try:
        assert not watch.stopping("child") and not watch.stopping("me")
        assert watch.stopping("never followed")
        os.kill(child.pid, signal.SIGKILL)
        assert watch.stopping("child")
        wait_until(lambda: child.poll() is not None)
        assert watch.stopping("child")
    finally:
        child.kill()
        child.wait()
        watch.close()
    assert watch.stopping("me")  # closed (its group is): it opens nothing again
    watch.follow("me", os.getpid())
    assert watch.stopping("me")


def test_a_process_that_has_just_taken_its_kill_is_stopping():
    """A killed process takes its SIGKILL a few microseconds before it is marked exiting,
    and ``stat`` shows neither meanwhile: looked at right after each of many kills, the
    watch must never say such a process goes on (before, about one look in a hundred
    did)."""
    missed = 0
    for _ in range(100):
        child = subprocess.Popen(["sleep", "60"])
        watch = ProcessWatch()
        watch.follow(0, child.pid)
        try:
            assert not watch.stopping(0)
            os.kill(child.pid, signal.SIGKILL)
            missed += not watch.stopping(0)
        finally:
            child.kill()
            child.wait()
            watch.close()
    assert missed == 0


def _sleeper_at(pid: int | None = None) -> subprocess.Popen:
    """A ``sleep`` process, given ``pid`` (a PID just freed) where asked: the kernel hands
    out the PID after ``ns_last_pid``, as it would after a long run of other processes."""
    if pid is not None:
        with open("/proc/sys/kernel/ns_last_pid", "w") as last:
            last.write(str(pid - 1))
    return subprocess.Popen(["sleep", "60"])


def _can_choose_pids() -> bool:
    return os.access("/proc/sys/kernel/ns_last_pid", os.W_OK)


@pytest.mark.skipif(not _can_choose_pids(), reason="needs root to choose the next PID")
def test_a_reused_pid_is_neither_taken_for_the_dead_rank_nor_hidden_from_its_new_one():
    """A rank's process dies and is reaped, and another process gets its PID. Unless the
    rank says hello again from that process, the watch still says the rank stopped; once
    it does (torchrun restarted the rank, which got the old PID), the new process is the
    rank's, and it runs. Keyed by PID, the watch took one for the other."""
    first = _sleeper_at()
    pid = first.pid
    watch = ProcessWatch()
    watch.follow(1, pid)
    again = None
    try:
        assert not watch.stopping(1)
        first.kill()
        first.wait()
        again = _sleeper_at(pid)
        if again.pid != pid:
            pytest.skip("another process took the PID first")
        assert watch.stopping(1)  # a stranger at the old PID is not the rank
        watch.follow(1, again.pid)  # the rank's hello from its new process
        assert not watch.stopping(1)
        again.kill()
        assert watch.stopping(1)
    finally:
        for process in (first, again):
            if process is not None:
                process.kill()
                process.wait()
        watch.close()


def launcher_on(tmp_path, script: str) -> tuple[LocalLauncher, RunDir]:
    """A launcher whose "python" is ``script`` (a shell script), its run dir made."""
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\n{script}\n")
    python.chmod(0o755)
    run_dir = RunDir.reserve()
    shape = GroupShape(str(python), 1, None, 0, None, False, dict(os.environ), str(tmp_path))
    launcher = LocalLauncher(run_dir, shape)
    run_dir.make()
    launcher.process.wait()  # it ended before the kernel said go
    return launcher, run_dir


def test_a_torchrun_that_ended_before_it_started_says_how_and_what_it_printed(tmp_path):
    launcher, run_dir = launcher_on(tmp_path, "echo 'no torch here' >&2; exit 3")
    try:
        with pytest.raises(NbddpError, match=r"exit code 3\); it said:\nno torch here"):
            launcher.go()
    finally:
        launcher.stop()
        run_dir.remove()


def test_a_torchrun_ended_by_the_ctrl_c_that_reached_it_as_it_started_is_the_interrupt(
        tmp_path):
    """Python gives a new child default signal handlers a moment before the child makes
    its own session: a Ctrl-C to the kernel's process group at that instant ends it."""
    launcher, run_dir = launcher_on(tmp_path, "kill -INT $$")
    try:
        with pytest.raises(KeyboardInterrupt):
            launcher.go()
    finally:
        launcher.stop()
        run_dir.remove()


def test_a_relay_serves_many_ranks_where_the_machine_has_a_core_for_it(monkeypatch):
    uses_relay, fewest = cores.uses_relay, cores.RELAY_FROM
    monkeypatch.setattr(cores, "usable_cores", lambda: 64)
    assert not uses_relay(fewest - 1)  # (few ranks: the hop costs more than it saves)
    assert uses_relay(fewest)
    assert uses_relay(63) and not uses_relay(64)  # (a core for it beside every rank)
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    assert not uses_relay(fewest)  # (it would take CPU from the ranks)


CPU = GroupShape(sys.executable, 4, "", 0, "gloo", True, {}, "/")


def test_a_kernel_held_to_one_core_counts_one():
    """As in a SLURM step or a cpuset given one core of a larger machine."""
    code = ("import os; from nbddp._local.cores import usable_cores; "
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); print(usable_cores())")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, timeout=60)
    assert found.stdout.split() == ["1"]


def test_a_container_s_cpu_quota_caps_the_cores(tmp_path):
    """A container's ``--cpus 2.5`` (cgroup v2) on a larger machine: 3 cores, whatever
    its affinity shows; no quota (``max``, v1's ``-1``): the affinity."""
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cpu_quota(tmp_path) == 2.5
    assert usable_cores(tmp_path) == min(3, affinity)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(tmp_path) is None and usable_cores(tmp_path) == affinity
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(v1) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    assert cpu_quota(v1) == 0.5 and usable_cores(v1) == 1
    assert cpu_quota(tmp_path / "none") is None  # (no cgroup files: nothing known)
