"""Where the suite's time goes: each test's wall time and CPU, and how busy the machine was.

pytest's ``--durations`` says how long each test took, not whether it kept the cores
busy or waited; on CI's 2 cores that is what decides how tests share the lanes
(tests/conftest.py) and which are worth making cheaper. At the end of a run this prints:

- the run's wall time, and the CPU its processes used (pytest's own, and every
  descendant's once reaped: pytest is a child subreaper, so an orphaned rank is counted
  too), as cores' worth;
- how busy the whole machine's cores were meanwhile (``/proc/stat``), which counts the
  other lane too;
- the tests that used the most CPU, beside their wall time.

A test's CPU is counted when its processes are reaped: a module's Ray cluster, stopped
by the module's last test, is counted there.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field

import pytest

SHOWN = 15
"""How many of the tests that used the most CPU are named."""


def _cpu_seconds() -> float:
    """CPU (user and system) of this process and of its reaped descendants."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


def _machine_ticks() -> tuple[int, int]:
    """The machine's busy and total CPU ticks since boot, all cores (``/proc/stat``)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = fields[3] + fields[4]  # idle and iowait
    total = sum(fields[:8])  # (guest time is counted in user already)
    return total - idle, total


@dataclass(eq=False)  # (pytest keeps its plugins in a set)
class SuiteTime:
    """The pytest plugin: registered by tests/conftest.py."""

    started: float = field(default_factory=time.monotonic)
    cpu_at_start: float = field(default_factory=_cpu_seconds)
    ticks_at_start: tuple[int, int] = field(default_factory=_machine_ticks)
    tests: list[tuple[float, float, str]] = field(default_factory=list)
    """(CPU seconds, wall seconds, test id) of each test run."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        wall, cpu = time.monotonic(), _cpu_seconds()
        yield
        self.tests.append((_cpu_seconds() - cpu, time.monotonic() - wall, item.nodeid))

    def pytest_terminal_summary(self, terminalreporter):
        if not self.tests:
            return
        wall = time.monotonic() - self.started
        cpu = _cpu_seconds() - self.cpu_at_start
        (busy_now, total_now), (busy_then, total_then) = _machine_ticks(), self.ticks_at_start
        busy, total = busy_now - busy_then, total_now - total_then
        write = terminalreporter.write_line
        terminalreporter.section("where the time went (tests/suite_time.py)")
        write(f"{len(self.tests)} tests in {wall:.0f} s; their processes used {cpu:.0f} s "
              f"of CPU ({cpu / wall:.2f} cores on average); the "
              f"machine's {os.cpu_count()} cores were {100 * busy / max(total, 1):.0f}% busy")
        write(f"the {SHOWN} tests that used the most CPU (CPU s, wall s):")
        for test_cpu, test_wall, nodeid in sorted(self.tests, reverse=True)[:SHOWN]:
            write(f"  {test_cpu:7.1f} {test_wall:7.1f}  {nodeid}")
