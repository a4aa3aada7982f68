"""Benchmark session snapshots: what they cost a cell, and what they save when a rank dies.

Through a real Jupyter kernel holding two sessions of 2 CPU ranks (gloo), one with
snapshots on and one with them off, each holding the same state: a model and its SGD
momentum of ``--gib`` GiB per rank. Cells are timed by the client from the execute
request until the kernel is idle, typed ``--gap`` seconds apart, the two sessions
alternated (each other round the other first):

- **a cell that changes nothing** (``session.run(noop)``): ON against OFF. Target: at
  most 0.5 ms more.
- **a training step** that changes all of it (a backward and an optimizer step: the
  weights and the momentum, ``--gib`` GiB): the cell ON against OFF (what the snapshot
  taken at rest costs the cell, if anything), and the time from the cell's end until
  every rank's snapshot file is there (written while the next cell is typed). Target:
  the two together at most 0.5 s per GiB changed.
- **a rank killed** (SIGKILL, between cells) and the next cell: ON the fresh ranks load
  the snapshot, OFF they start empty. Target: ON at most OFF (a cold start) + 1 s + the
  state at 1 GB/s (a rank's: the ranks load theirs at once).

The ON session's snapshot folder is read from its private attribute (this script
measures; nbddp does not change for it). Every value is checked. The record
(``_record.py``) keeps every sample.
Run: ``python benchmarks/bench_snapshots.py [--rounds 10] [--gib 1] [--kills 3]
[--gap 1.0] [--noisy] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo, even on a GPU machine
os.environ["NBDDP_STANDBY"] = "0"  # nothing starting in the background while timing

from _record import Record, add_options  # noqa: E402

NOOP_TARGET = 0.0005  # seconds a cell that changes nothing may take more, ON
PER_GIB_TARGET = 0.5  # seconds a snapshot may take per GiB changed
RESTORE_SLACK = 1.0  # seconds beyond a cold start a restore may take, plus its bytes at:
RESTORE_RATE = 1e9  # bytes a second

SETUP = """
import os, signal, time, glob
import nbddp
def build(gib):
    global model, opt, data
    import torch
    side = int((gib * 2**30 / 2 / 4 / 2) ** 0.5)  # two square layers: half the bytes
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(side, side, bias=False),
                                torch.nn.Linear(side, side, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    data = torch.randn(4, side)
    step()
    return sum(p.numel() * 4 * 2 for p in model.parameters())
def step():
    opt.zero_grad()
    model(data).sum().backward()
    opt.step()
    return float(model[0].weight[0, 0])
def noop():
    return None
def check():
    return (float(model[0].weight[0, 0]), len(opt.state))
sessions = {"on": nbddp.Session(2, snapshots=True, output="none"),
            "off": nbddp.Session(2, output="none")}
sizes = {name: s.run(build, GIB) for name, s in sessions.items()}
"""


def snapshot_files_for(cell: int) -> str:
    return (f"len(glob.glob(str(sessions['on']._ranks.snapshots.folder) + "
            f"'/rank*-cell{cell}.snapshot'))")


class Kernel:
    """A Jupyter kernel and its client."""

    def __init__(self, cwd: str) -> None:
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=cwd)

    def run(self, code: str, timeout: float = 600) -> str:
        """Run ``code``; its value's text (the kernel idle again)."""
        shown: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "execute_result":
                shown.append(msg["content"]["data"].get("text/plain", ""))

        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=hook)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"cell failed: {code[:60]!r}: {reply['content'].get('evalue')}")
        return shown[-1] if shown else ""

    def timed(self, code: str) -> tuple[float, str]:
        start = time.perf_counter()
        value = self.run(code)
        return time.perf_counter() - start, value

    def close(self) -> None:
        try:
            self.run("for s in sessions.values(): s.close()", 120)
        finally:
            self.client.stop_channels()
            self.manager.shutdown_kernel(now=False)


def sides(round_number: int) -> tuple[str, str]:
    return ("on", "off") if round_number % 2 == 0 else ("off", "on")


def noop_cells(k: Kernel, rounds: int, gap: float) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(rounds):
        for side in sides(r):
            time.sleep(gap)
            took, value = k.timed(f"sessions[{side!r}].run(noop)")
            assert value == "", value
            times[side].append(took)
    return times


def step_cells(k: Kernel, rounds: int, gap: float) -> dict[str, list[float]]:
    """Each step's cell, ON and OFF; and ON, from its end until every rank's snapshot
    file is there."""
    times: dict[str, list[float]] = {"on": [], "off": [], "written_after_s": []}
    for r in range(rounds):
        for side in sides(r):
            time.sleep(gap)
            took, value = k.timed(f"sessions[{side!r}].run(step)")
            ended = time.perf_counter()
            times[side].append(took)
            if side == "on":
                cell = int(k.run("sessions['on'].runs"))
                while int(k.run(snapshot_files_for(cell))) < 2:
                    time.sleep(0.005)
                times["written_after_s"].append(time.perf_counter() - ended)
    return times


def kills(k: Kernel, count: int, gap: float) -> dict[str, list[float]]:
    """A rank killed between cells, and the next cell: ON restores, OFF starts empty."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(count):
        for side in sides(r):
            before = k.run(f"sessions[{side!r}].run(check)") if side == "on" else None
            k.run(f"os.kill(sessions[{side!r}].status().pids[1], signal.SIGKILL)")
            time.sleep(gap)
            if side == "on":
                took, value = k.timed("sessions['on'].run(check)")
                assert value == before, (value, before)  # (the state came back)
            else:
                took, _ = k.timed("sessions['off'].run(noop)")
                k.run("sessions['off'].run(build, GIB)")  # (its state, for the next)
            times[side].append(took)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="cells each side (default 10)")
    parser.add_argument("--gib", type=float, default=1.0,
                        help="GiB of model and momentum per rank (default 1)")
    parser.add_argument("--kills", type=int, default=3, help="ranks killed each side")
    parser.add_argument("--gap", type=float, default=1.0,
                        help="seconds between cells, as typed (default 1.0)")
    add_options(parser)
    opts = parser.parse_args()
    record = Record.start("snapshots", opts)
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as cwd:
        os.environ["NBDDP_RUNS_DIR"] = str(Path(cwd) / "runs")
        k = Kernel(cwd)
        try:
            sizes = ast.literal_eval(k.run(f"GIB = {opts.gib}\n" + SETUP + "sizes", 900))
            state = sizes["on"]
            print(f"state per rank: {state / 2**30:.2f} GiB", flush=True)
            noop = noop_cells(k, opts.rounds, opts.gap)
            steps = step_cells(k, opts.rounds, opts.gap)
            killed = kills(k, opts.kills, opts.gap)
        finally:
            k.close()
    extra_noop = median(noop["on"]) - median(noop["off"])
    snapshot_s = median(steps["on"]) - median(steps["off"]) + median(steps["written_after_s"])
    per_gib = snapshot_s / (state / 2**30)
    restore_limit = median(killed["off"]) + RESTORE_SLACK + state / RESTORE_RATE
    figures = {
        "noop_extra_s": extra_noop, "noop_met": extra_noop <= NOOP_TARGET,
        "snapshot_s_per_gib": per_gib, "snapshot_met": per_gib <= PER_GIB_TARGET,
        "restore_s": median(killed["on"]), "restore_limit_s": restore_limit,
        "restore_met": median(killed["on"]) <= restore_limit}
    label = record.label
    print(f"\nsnapshots, 2 CPU ranks (gloo), {state / 2**30:.2f} GiB per rank, medians, "
          f"cells {opts.gap} s apart{label}:")
    print(f"  a cell that changes nothing: ON {median(noop['on']) * 1000:.2f} ms, OFF "
          f"{median(noop['off']) * 1000:.2f} ms, {extra_noop * 1000:+.2f} ms (target <= "
          f"+{NOOP_TARGET * 1000:.1f} ms: {'met' if figures['noop_met'] else 'MISSED'})")
    print(f"  a step changing it all: ON {median(steps['on']):.3f} s, OFF "
          f"{median(steps['off']):.3f} s, written {median(steps['written_after_s']):.3f} s "
          f"after; {per_gib:.3f} s per GiB (target <= {PER_GIB_TARGET} s: "
          f"{'met' if figures['snapshot_met'] else 'MISSED'})")
    print(f"  a rank killed, the next cell: ON (restored) {median(killed['on']):.2f} s, "
          f"OFF (empty) {median(killed['off']):.2f} s; limit {restore_limit:.2f} s: "
          f"{'met' if figures['restore_met'] else 'MISSED'}")
    record.write({"nprocs": 2, "state_bytes_per_rank": state, "noop_s": noop,
                  "step_s": steps, "killed_next_cell_s": killed, **figures})


if __name__ == "__main__":
    main()
