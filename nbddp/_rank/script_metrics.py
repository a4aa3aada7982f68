"""``nbddp.log`` / ``nbddp.progress`` in a script run (torchrun, srun, plain python).

No kernel is listening, and ``log`` must still not synchronise the ranks, so each rank
appends its records to ``rank-N.jsonl`` in ``$NBDDP_METRICS_DIR`` (default
``./nbddp-metrics``, beside the job's output on a shared filesystem); rank 0 reads every
rank's file, averages each step with the same ``History`` the notebook uses, prints the
averages as readable lines (at most one a second, and the last one) and writes them to
``metrics.jsonl``.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from .._wire.history import History, averaged_over
from .._wire.messages import Metrics
from .._wire.rundir import METRICS
from .reporter import Reporter

_INTERVAL = 0.5
_FINAL_WAIT = 10.0


def _records_of(folder: Path, rank: int) -> Path:
    """Where ``rank`` appends its records in a script run's metrics folder."""
    return folder / f"rank-{rank}.jsonl"


class ScriptReporter:
    """One rank's log records to its file; on rank 0, the averaging and the printing.

    Records are buffered, turned into numbers and written by the same ``Reporter``
    thread a launched rank uses, so ``log`` stays off the training thread's clock (no
    ``.item()`` sync on a GPU tensor there).
    """

    def __init__(self, rank: int, world: int, folder: Path) -> None:
        self.rank, self.world, self.folder = rank, world, folder
        folder.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = _records_of(folder, rank).open("w")
        self._reporter = Reporter(rank, self._write)
        self._history = History(world, folder / METRICS) if rank == 0 else None
        self._offsets = [0] * world
        self._printed = 0.0
        self._printed_row: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._history is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="nbddp-script")
            self._thread.start()
        atexit.register(self.close)

    def log(self, step: int | None, metrics: dict[str, Any], for_all: bool = False) -> None:
        self._reporter.log(step, metrics, for_all)

    def _write(self, batch: Metrics) -> None:
        """The reporter's send: this rank's records, appended as JSON lines (a third
        item marks a record that speaks for every rank)."""
        for step, values in batch.records:
            self._file.write(json.dumps([step, values]) + "\n")
        for step, values in batch.for_all:
            self._file.write(json.dumps([step, values, True]) + "\n")
        self._file.flush()

    def _loop(self) -> None:
        while not self._stop.wait(_INTERVAL):
            self._average()

    def _average(self, final: bool = False, quiet: bool = False) -> bool:
        """Rank 0: read what every rank appended; True once every rank said it is done."""
        if self._history is None:
            return True
        done = 0
        for rank in range(self.world):
            records, for_all, finished = self._read(rank)
            self._history.add(rank, records)
            self._history.add(rank, for_all, for_all=True)
            done += finished
        self._history.tick()
        row = self._history.latest
        due = final or time.monotonic() - self._printed >= 1.0
        if row and due and not quiet and row != self._printed_row:
            self._printed, self._printed_row = time.monotonic(), dict(row)
            metrics = " ".join(f"{k}={v:.4g}" for k, v in row.items() if k not in ("step", "ranks"))
            print(f"[nbddp] step {row['step']}: {metrics} ({averaged_over(row)})",
                  flush=True)
        return done == self.world

    def _read(self, rank: int) -> tuple[list[tuple[int, dict[str, float]]],
                                        list[tuple[int, dict[str, float]]], bool]:
        path = _records_of(self.folder, rank)
        try:
            with path.open() as f:
                f.seek(self._offsets[rank])
                text = f.read()
        except FileNotFoundError:
            return [], [], False
        complete = text[:text.rfind("\n") + 1]
        self._offsets[rank] += len(complete.encode())
        records: list[tuple[int, dict[str, float]]] = []
        for_all: list[tuple[int, dict[str, float]]] = []
        finished = False
        for line in complete.splitlines():
            item = json.loads(line)
            if item == "done":
                finished = True
            else:
                (for_all if len(item) > 2 else records).append((item[0], item[1]))
        return records, for_all, finished

    def close(self) -> None:
        """At exit: this rank says it is done; rank 0 waits for the others, then averages."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._reporter.close()  # what is still buffered is written first
        self._file.write(json.dumps("done") + "\n")
        self._file.close()
        deadline = time.monotonic() + _FINAL_WAIT
        while not self._average(quiet=True) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._history is not None:
            self._history.close()
            self._average(final=True)


def script_reporter() -> ScriptReporter | None:
    """The reporter of a script run: a process group is up and no kernel launched us."""
    torch = sys.modules.get("torch")  # no torch imported: no process group either
    dist = getattr(torch, "distributed", None) if torch else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    folder = Path(os.environ.get("NBDDP_METRICS_DIR", "nbddp-metrics"))
    return ScriptReporter(dist.get_rank(), dist.get_world_size(), folder)
