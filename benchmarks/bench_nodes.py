"""Benchmark the kernel's side of a session on 128 and 1,024 simulated nodes.

The kernel's side is real: a session (``nbddp.Session``'s own code), its group, channel
(TCP, the run's key, every frame sealed and checked), supervisor, records and panel. By
default it runs in a real Jupyter kernel (``--where kernel``), as a person meets it: the
session made in a cell, then ``session.run(noop)`` cells with the text panel
(``NBDDP_DISPLAY=text``), each timed by the Jupyter client from its execute request to
the kernel going idle, the kernel's CPU (every thread) read from /proc. ``--where
python`` runs it in this process instead, output off.

The nodes are not real: a few processes each hold many nodes, and each node is nbddp's
real relay (``_rank.relay.NodeRelay``, its own authenticated connection to the kernel)
in front of simulated ranks, which say hello, answer the roll call, and answer each
Start at once (``noop``), or first log a metric ``--rate`` times a second for
``--seconds`` (``metrics``), as a rank's reporter sends them: a batch about ten times a
second.

The relays are placed as a session places them (``--layout auto``): past
``TREE_FROM`` nodes they form a tree (``_wire.relay_tree``: the kernel speaks to one
head per group of relays, each a real relay, merging its group's batches); ``--layout
flat`` keeps every relay on a link to the kernel, ``--layout tree`` forms a tree at any
count. A head's work is on its node, in the simulation's processes, not measured.

Cells come in two kinds, alternated, each reported under its own label:

- **typed**: ``--gap`` seconds after the last cell ended (``TYPED_GAP`` by default,
  ``bench_code.py``'s spacing of typed cells), more than ``HEARD_LATELY``: as for a
  cell a person types, the session first calls the roll of every rank;
- **back to back**: at once after the one before, which the ranks' links were heard
  from a moment ago: no roll call, as for cells run one after another.

Measured: the kernel's CPU time and the wall time per no-op cell of each kind (``--cells``
of each, after a warm-up), and the kernel's CPU share of one core while every rank logs.
Targets (the issue's): a no-op cell on 1,024 nodes of 8 ranks under
``CELL_CPU_TARGET_MS`` of kernel CPU; 8,192 ranks' metrics at ``METRICS_RATE`` a second
under one core.

Writes its record (``_record.py``, every cell's figures) under ``benchmarks/results/``.
Run: ``python benchmarks/bench_nodes.py [--nodes 128 1024] [--per-node 8] [--gap S]
[--layout auto|flat|tree] [--where kernel python] [--noisy] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

os.environ["NBDDP_STANDBY"] = "0"
os.environ["NBDDP_DISPLAY"] = "text"

import nbddp  # noqa: E402
from nbddp._local.backend import LocalBackend  # noqa: E402
from nbddp._rank.relay_placement import placed_relay  # noqa: E402
from nbddp._run.config import RunOptions  # noqa: E402
from nbddp._run.groups.roll_calls import HEARD_LATELY  # noqa: E402
from nbddp._run.groups.shape import GroupShape  # noqa: E402
from nbddp._run.groups.waiting import WaitingGroup  # noqa: E402
from nbddp._run.records import FolderPerCell  # noqa: E402
from nbddp._run.session.ranks import SessionRanks  # noqa: E402
from nbddp._wire.channel import ChannelClient, ChannelServer  # noqa: E402
from nbddp._wire.frames import HEADER_SIZE, decode  # noqa: E402
from nbddp._wire.handshake import new_key  # noqa: E402
from nbddp._wire.messages import (  # noqa: E402
    Hello,
    Metrics,
    Present,
    Ready,
    Result,
    RollCall,
    Sequenced,
    Start,
)
from nbddp._wire.payload import dumps_value  # noqa: E402
from nbddp._wire.rank_stats import RankStats  # noqa: E402
from nbddp._wire.relay_tree import RelayTree, uses_tree  # noqa: E402
from nbddp._wire.rundir import RunDir  # noqa: E402

CELL_CPU_TARGET_MS = 50.0  # 1,024 nodes of 8 ranks
METRICS_TARGET = 1.0  # of one core, 8,192 ranks at METRICS_RATE
METRICS_RATE = 10.0  # steps/s per rank
TYPED_GAP = 1.5
"""Seconds between one cell's end and the next typed one: ``bench_code.py``'s spacing of
typed cells, more than ``HEARD_LATELY``, so that the session calls the roll first."""
HERE = Path(__file__).resolve().parent
PROCESSES = 8  # that hold the simulated nodes
REPORTS_PER_SECOND = 10  # a rank's reporter sends its batch about this often


# --- the nodes' side (``--serve``: a process of simulated nodes) ----------------------


class SimulatedRanks:
    """One node's ranks behind its real relay: each says hello and is ready, answers
    the roll call, and answers a Start (after logging, in ``metrics`` mode)."""

    def __init__(self, node: int, per_node: int, mode: str, deliver: Callable[[Any], None]
                 ) -> None:
        self.ranks = range(node * per_node, (node + 1) * per_node)
        self._node, self._mode, self._deliver = f"sim{node}", mode, deliver
        self._seq = dict.fromkeys(self.ranks, 0)
        self._lock = threading.Lock()
        for local, rank in enumerate(self.ranks):
            self._say(rank, Hello(rank, os.getpid(), self._node, local))
            self._say(rank, Ready(rank))

    def _say(self, rank: int, message: Any) -> None:
        with self._lock:
            seq = self._seq[rank]
            self._seq[rank] = seq + 1
        self._deliver(Sequenced(seq, message))

    def send_frame_to_each(self, ranks: Iterable[int], frame: bytes) -> set[int]:
        return {rank for rank in ranks if not self.send_encoded(rank, frame)}

    def send_encoded(self, rank: int, frame: bytes) -> bool:
        if rank not in self.ranks:
            return False
        message = decode(frame[HEADER_SIZE:])
        if isinstance(message, RollCall):
            self._say(rank, Present(rank, message.call))
        elif isinstance(message, Start) and rank == self.ranks[-1]:  # (once per node)
            if self._mode == "noop":  # (at once: a node's ranks answer in parallel)
                self._run(message)
            else:
                threading.Thread(target=self._run, args=(message,), daemon=True).start()
        return True

    def _run(self, start: Start) -> None:
        if self._mode.startswith("metrics"):
            _, seconds, rate = self._mode.split(":")
            self._log(float(seconds), float(rate))
        answering = start.options.answering
        for rank in self.ranks:
            value = dumps_value(None) if rank == answering else None
            self._say(rank, Result(rank, value, stats=RankStats(
                rank, self._node, os.getpid(), None, 100.0, None, 0),
                assigned=() if rank == answering and start.session else None))

    def _log(self, seconds: float, rate: float) -> None:
        """Every rank logs ``rate`` steps a second, sent in batches as a reporter does."""
        step, began = 0, time.monotonic()
        per_batch = max(1, round(rate / REPORTS_PER_SECOND))
        while time.monotonic() - began < seconds:
            records = [(step + i, {"loss": 1.0 / (step + i + 1)}) for i in range(per_batch)]
            step += per_batch
            for rank in self.ranks:
                self._say(rank, Metrics(rank, records, (step, None, None)))
            time.sleep(max(0.0, began + step / rate - time.monotonic()))

    def close(self) -> None:
        pass


def serve(host: str, port: int, key_file: str, first: int, count: int, per_node: int,
          mode: str, tree: bool) -> None:
    """Nodes ``first`` to ``first + count``, each a real relay connected to the kernel
    (``tree``: placed in the kernel's tree of relays, as a session's are); until the
    kernel closes every link (or this process is killed)."""
    key = Path(key_file).read_bytes()
    relays = [placed_relay(lambda: ChannelClient((host, port), key), key,
                           lambda deliver, node=node: SimulatedRanks(node, per_node, mode,
                                                                     deliver), tree=tree)
              for node in range(first, first + count)]  # (a head never waits to be placed)
    for relay in relays:
        relay._sender.join()


# --- the kernel's side ----------------------------------------------------------------


class SimulatedNodes:
    """The launcher of a simulated group: the processes that hold its nodes."""

    def __init__(self, address: tuple[str, int], key_file: Path, nodes: int, per_node: int,
                 mode: str, tree: bool) -> None:
        share = -(-nodes // PROCESSES)
        self.processes = [
            subprocess.Popen([sys.executable, __file__, "--serve", address[0],
                              str(address[1]), str(key_file), str(first),
                              str(min(share, nodes - first)), str(per_node), mode,
                              str(int(tree))])
            for first in range(0, nodes, share)]

    def add_rank(self, pid: int) -> None:
        pass

    def wait(self) -> int:
        return max(process.wait() for process in self.processes)

    def stop(self, clean: bool = False) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.wait()

    def stopped_from_outside(self) -> str | None:
        return None


class SimulatedGroup(WaitingGroup):
    """A session's group whose ranks are simulated nodes' (see ``SimulatedRanks``)."""

    def __init__(self, shape: GroupShape, nodes: int, per_node: int, mode: str,
                 tree: bool) -> None:
        run_dir = RunDir.reserve()
        run_dir.make()
        super().__init__(shape, run_dir)
        self.run_dir.write_private(self.run_dir.key, new_key())
        self._server = ChannelServer(("127.0.0.1", 0), self.run_dir.key.read_bytes(),
                                     self._deliver, tree=RelayTree(nodes) if tree else None)
        assert self._server.port is not None
        self._follow_launcher(SimulatedNodes(("127.0.0.1", self._server.port),
                                             self.run_dir.key, nodes, per_node, mode, tree))


class SimulatedBackend(LocalBackend):
    start_timeout = 600.0

    def __init__(self, nodes: int, per_node: int, mode: str, tree: bool,
                 output: str = "none") -> None:
        super().__init__(RunOptions(nprocs=nodes * per_node, output=output).config(
            nodes * per_node))
        self.nodes, self.per_node, self.mode, self.tree = nodes, per_node, mode, tree

    def session_group(self, standby: bool = True) -> WaitingGroup:
        return SimulatedGroup(self.shape, self.nodes, self.per_node, self.mode, self.tree)

    def session_records(self) -> FolderPerCell:
        """A cluster session's records: a folder per cell (the ranks' logs are theirs to
        make, past ``MAKE_LOGS_UP_TO``)."""
        return FolderPerCell(self.config.nprocs)


def simulated_session(nodes: int, per_node: int, mode: str, layout: str = "auto",
                      output: str = "none") -> nbddp.Session:
    """A session as ``nbddp.Session()`` makes one, on simulated nodes (``layout``: as
    ``--layout``; ``output``: as ``Session``'s, ``"rank0"`` for its panel)."""
    tree = layout == "tree" or (layout == "auto" and uses_tree(nodes))
    session = nbddp.Session.__new__(nbddp.Session)
    session._begin(SessionRanks.start_on(SimulatedBackend(nodes, per_node, mode, tree, output)))
    session._wait_ready()
    return session


def noop() -> None:
    """The no-op cell."""


Cell = Callable[[], tuple[float, float]]
"""One no-op cell, run and timed: the driving process's CPU seconds and the wall's."""


def spaced_cells(cell: Cell, cells: int, gap: float) -> dict[str, dict[str, list[float]]]:
    """``cells`` pairs, after three untimed cells: a cell typed ``gap`` seconds after the
    last one ended (the session calls the roll first), then one at once (back to back:
    no roll call). CPU and wall seconds of each."""
    for _ in range(3):
        cell()  # warm-up
    spaced: dict[str, dict[str, list[float]]] = {
        kind: {"cpu_s": [], "wall_s": []} for kind in ("typed", "back_to_back")}
    for _ in range(cells):
        for kind in ("typed", "back_to_back"):
            if kind == "typed":
                time.sleep(gap)
            cpu, wall = cell()
            spaced[kind]["cpu_s"].append(cpu)
            spaced[kind]["wall_s"].append(wall)
    return spaced


def in_this_process(nodes: int, per_node: int, opts: argparse.Namespace) -> dict[str, Any]:
    """The figures of one shape in this process: ``Session.run``, output off."""
    def cpu_and_wall(fn: Callable[[], Any]) -> tuple[float, float]:
        cpu, wall = time.process_time(), time.perf_counter()
        fn()
        return time.process_time() - cpu, time.perf_counter() - wall

    figures: dict[str, Any] = {}
    began = time.perf_counter()
    session = simulated_session(nodes, per_node, "noop", opts.layout)
    try:
        figures["start_s"] = time.perf_counter() - began
        figures |= spaced_cells(lambda: cpu_and_wall(lambda: session.run(noop)),
                                opts.cells, opts.gap)
    finally:
        session.close()
    session = simulated_session(nodes, per_node, f"metrics:{opts.seconds}:{opts.rate}",
                                opts.layout)
    try:
        cpu, wall = cpu_and_wall(lambda: session.run(noop))
        figures["metrics_cpu_share"] = cpu / wall
    finally:
        session.close()
    return figures


KERNEL_SETUP = """from bench_nodes import simulated_session
def noop():
    pass
"""
"""The notebook's first cell: its no-op is its own (``__main__``'s, pickled by value)."""


def in_a_kernel(nodes: int, per_node: int, opts: argparse.Namespace) -> dict[str, Any]:
    """The figures of one shape through a real Jupyter kernel, as a person meets them:
    the session made in a cell, ``session.run(noop)`` cells, the text panel shown (the
    kernel's CPU read from /proc, every thread; each cell timed by the client from its
    execute request to the kernel going idle)."""
    from bench_scale import kernel_cpu
    from bench_session import run_cell
    from jupyter_client.manager import start_new_kernel

    env = {**os.environ, "NBDDP_DISPLAY": "text",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE),
                                                       os.environ.get("PYTHONPATH")]))}
    make = ("session = simulated_session({nodes}, {per_node}, {mode!r}, {layout!r}, "
            "output='rank0')")
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as cwd:
        manager, client = start_new_kernel(kernel_name="python3", cwd=cwd, env=env)
        pid = manager.provisioner.process.pid

        def cell(code: str = "session.run(noop)", timeout: float = 600) -> tuple[float, float]:
            cpu, wall = kernel_cpu(pid), time.perf_counter()
            run_cell(client, code, timeout)
            return kernel_cpu(pid) - cpu, time.perf_counter() - wall

        try:
            run_cell(client, KERNEL_SETUP, 120)
            figures["start_s"] = cell(make.format(nodes=nodes, per_node=per_node,
                                                  mode="noop", layout=opts.layout))[1]
            figures |= spaced_cells(cell, opts.cells, opts.gap)
            run_cell(client, "session.close()", 120)
            run_cell(client, make.format(nodes=nodes, per_node=per_node, layout=opts.layout,
                                         mode=f"metrics:{opts.seconds}:{opts.rate}"), 600)
            cpu, wall = cell()
            figures["metrics_cpu_share"] = cpu / wall
            run_cell(client, "session.close()", 120)
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=False)
    return figures


WAYS = {"kernel": ("a real Jupyter kernel, text panel; kernel CPU from /proc, the mean",
                   in_a_kernel, statistics.mean),
        "python": ("this process, Session.run, output off; CPU the median",
                   in_this_process, statistics.median)}
"""Where the kernel's side runs: what the report says of it, the function that measures
a shape there, and how its CPU samples are summed up (/proc counts in clock ticks: a
mean, not a median)."""


def report(nodes: int, opts: argparse.Namespace, where: str, figures: dict[str, Any],
           label: str) -> None:
    """One shape's figures, back to back and typed each labelled, beside the targets."""
    _, _, average = WAYS[where]
    print(f"{nodes} nodes x {opts.per_node} ranks, {where}: start "
          f"{figures['start_s']:.1f} s{label}")
    for kind, said in (("back_to_back", "back-to-back cells (no roll call)"),
                       ("typed", f"typed cells, {opts.gap:g} s apart (roll call paid)")):
        cpu = 1000 * average(figures[kind]["cpu_s"])
        wall = 1000 * statistics.median(figures[kind]["wall_s"])
        verdict = ""
        if nodes == 1024 and opts.per_node == 8:
            verdict = (f" (target < {CELL_CPU_TARGET_MS:g} ms: "
                       f"{'met' if cpu < CELL_CPU_TARGET_MS else 'MISSED'})")
        print(f"  {said:44} kernel CPU {cpu:8.2f} ms{verdict}, wall {wall:8.2f} ms",
              flush=True)
    share = figures["metrics_cpu_share"]
    verdict = ""
    if nodes == 1024 and opts.per_node == 8 and opts.rate == METRICS_RATE:
        verdict = f" (target < 1 core: {'met' if share < METRICS_TARGET else 'MISSED'})"
    print(f"  {'metrics, ' + f'{opts.rate:g} steps/s per rank':44} kernel CPU "
          f"{100 * share:.1f}% of a core{verdict}", flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        host, port, key_file, first, count, per_node, mode, tree = sys.argv[2:]
        serve(host, int(port), key_file, int(first), int(count), int(per_node), mode,
              tree == "1")
        return
    from _record import Record, add_options

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--cells", type=int, default=20,
                        help="no-op cells per shape, each of back-to-back and typed")
    parser.add_argument("--gap", type=float, default=TYPED_GAP,
                        help=f"seconds before a typed cell (default {TYPED_GAP:g}; more than "
                             f"HEARD_LATELY, {HEARD_LATELY:g}, so that it pays the roll call)")
    parser.add_argument("--seconds", type=float, default=5.0, help="of metrics per shape")
    parser.add_argument("--rate", type=float, default=METRICS_RATE,
                        help="metric steps/s per rank")
    parser.add_argument("--layout", choices=("auto", "flat", "tree"), default="auto",
                        help="the relays: as a session places them, or all on the kernel's "
                             "link, or in a tree at any count")
    parser.add_argument("--where", choices=tuple(WAYS), nargs="+", default=["kernel"],
                        help="the kernel's side in a real Jupyter kernel (default) and/or "
                             "in this process")
    add_options(parser)
    opts = parser.parse_args()
    if opts.gap <= HEARD_LATELY:
        parser.error(f"--gap must be more than HEARD_LATELY ({HEARD_LATELY:g} s): a cell "
                     "sooner goes without the roll call, as a back-to-back one does")
    record = Record.start("nodes", opts)
    results: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(),
                               "per_node": opts.per_node, "rate": opts.rate,
                               "layout": opts.layout, "gap_s": opts.gap}
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as tmp:
        os.environ["NBDDP_RUNS_DIR"] = str(Path(tmp) / "runs")  # keep the user's records
        for where in opts.where:
            said, measure, _ = WAYS[where]
            print(f"{where}: {said}", flush=True)
            results[where] = {}
            for nodes in opts.nodes:
                figures = measure(nodes, opts.per_node, opts)
                results[where][str(nodes)] = figures
                report(nodes, opts, where, figures, record.label)
    record.write(results)


if __name__ == "__main__":
    main()
