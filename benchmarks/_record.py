"""The record of one benchmark run: what it ran on, how quiet the machine was, its samples.

Every ``bench_*.py`` script goes through here, so that a figure in
``benchmarks/README.md`` can be traced to the run it came from:

- ``add_options(parser)`` gives a script ``--json PATH`` (where the record goes; by
  default ``benchmarks/results/NAME-YYYYmmdd-HHMM.json``) and ``--noisy``;
- ``Record.start(name, opts)``, before the script measures anything, reads the 1-minute
  load average, the machine and the commit, and refuses to go on (exits with a message)
  when the load is above ``QUIET_LOAD_PER_CORE`` per core (1.5 on 2 cores), unless
  ``--noisy`` was given: then the run goes on, and its record and printed figures say
  that they are noisy;
- ``record.write(figures)`` writes the record: the fields below, then the script's own
  figures with their raw samples, then the load after. A script may write it more than
  once (``bench_gpu.py`` does after each part, so a run stopped midway keeps its parts).

A record's fields, before the script's own::

    benchmark    the record's name (``code_shipping``, ``nodes``, ...)
    machine      cpu (model name), cores, python, commit, dirty, date
    load_before  the 1-minute load average before the run started
    load_limit   the load above which the run is noisy (0.75 per core)
    noisy        the load before was above the limit (the run went on with --noisy)
    options      the script's command-line options

and ``load_after`` last. The first results file (``code_shipping-20261206-1954.json``)
has ``machine`` (without ``dirty``), ``load_before``, its figures and ``load_after``:
the same fields, fewer of them.

``dirty`` says whether tracked files differed from the commit (files git does not track,
such as this run's own results file, do not count).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
QUIET_LOAD_PER_CORE = 0.75
"""Above this 1-minute load per core before a run starts, its figures are noise: the
ranks and the kernel would share the cores with someone else's work."""


def add_options(parser: argparse.ArgumentParser) -> None:
    """``--json PATH`` and ``--noisy``, which every benchmark takes."""
    parser.add_argument("--json", type=Path,
                        help="write the record here (default: benchmarks/results/"
                             "NAME-YYYYmmdd-HHMM.json)")
    parser.add_argument("--noisy", action="store_true",
                        help="run even when the machine is loaded; the record and the "
                             "figures are then marked noisy")


def machine(now: datetime.datetime) -> dict[str, Any]:
    """The CPU model, cores, Python, the commit (and whether the tree differs), the date."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):  # (not Linux)
        model = next((line.split(":", 1)[1].strip() for line in
                      Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), model)
    commit, dirty = _commit()
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "commit": commit, "dirty": dirty, "date": now.isoformat(timespec="seconds")}


def _commit() -> tuple[str, bool | None]:
    """``git rev-parse HEAD`` of this folder's repository, and whether tracked files
    differ from it (``"unknown"`` and None without git)."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True,
                                  timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return (head.strip() if head else "unknown"), (None if status is None else bool(status))


@dataclasses.dataclass
class Record:
    """One run's record: made by ``start`` before the run, written by ``write`` after."""

    name: str
    path: Path
    machine: dict[str, Any]
    load_before: float
    load_limit: float
    noisy: bool
    options: dict[str, Any]

    @classmethod
    def start(cls, name: str, opts: argparse.Namespace) -> Record:
        """The record of a run about to start; exits with a message when the machine is
        loaded and ``opts.noisy`` is not set."""
        now = datetime.datetime.now()
        load = os.getloadavg()[0]
        limit = QUIET_LOAD_PER_CORE * (os.cpu_count() or 1)
        path = opts.json or RESULTS / f"{name}-{now:%Y%m%d-%H%M}.json"
        record = cls(name, path, machine(now), load, limit, load > limit,
                     {key: str(value) if isinstance(value, Path) else value
                      for key, value in vars(opts).items()})
        if record.noisy and not opts.noisy:
            sys.exit(f"{name}: the 1-minute load is {load:.2f}, above {limit:.2f} "
                     f"({QUIET_LOAD_PER_CORE} per core on {os.cpu_count()} cores): the "
                     "figures would be noise. Wait for a quiet machine, or pass --noisy to "
                     "run anyway with every figure marked noisy.")
        dirty = " (tracked files changed)" if record.machine["dirty"] else ""
        print(f"{name}: commit {record.machine['commit'][:12]}{dirty}, "
              f"{record.machine['cpu']}, {record.machine['cores']} cores, load {load:.2f} "
              f"before start (limit {limit:.2f}){record.label}", flush=True)
        return record

    @property
    def label(self) -> str:
        """What a printed figure carries beside it: empty, or that the run is noisy."""
        return (f" [NOISY: load {self.load_before:.2f} before start, above "
                f"{self.load_limit:.2f}]" if self.noisy else "")

    def write(self, figures: dict[str, Any]) -> Path:
        """Write (or write again) the record with ``figures``: the script's own, with
        their raw samples."""
        clash = set(figures) & {"benchmark", "machine", "load_before", "load_limit",
                                "noisy", "options"}
        if clash:
            raise ValueError(f"a record's own fields among the figures: {sorted(clash)}")
        record = {"benchmark": self.name, "machine": self.machine,
                  "load_before": self.load_before, "load_limit": self.load_limit,
                  "noisy": self.noisy, "options": self.options, **figures,
                  "load_after": os.getloadavg()[0]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"wrote {self.path}{self.label}", flush=True)
        return self.path
