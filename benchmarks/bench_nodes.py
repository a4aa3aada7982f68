"""Benchmark the kernel's side of a session past this machine: 128 and 1,024 simulated
nodes (issue: many ranks).

The kernel's side is real: a session (``nbddp.Session``'s own code), its group, channel
(TCP, the run's key, every frame sealed and checked), supervisor, records and text panel,
in this process. The nodes are not: a few processes each hold many nodes, and each node
is nbddp's real relay (``_rank.relay.NodeRelay``, its own authenticated connection to the
kernel) in front of simulated ranks, which say hello, answer the roll call, and answer
each Start at once (``noop``), or first log a metric ``--rate`` times a second for
``--seconds`` (``metrics``), as a rank's reporter sends them: a batch about ten times a
second.

The relays are placed as a session places them (``--layout auto``): past
``TREE_FROM`` nodes they form a tree (``_wire.relay_tree``: the kernel speaks to one
head per group of relays, each a real relay, merging its group's batches); ``--layout
flat`` keeps every relay on a link to the kernel, ``--layout tree`` forms a tree at any
count. A head's work is on its node, in the simulation's processes, not measured.

Measured, in this process: the CPU time (every thread) and wall time per no-op cell (the
median of ``--cells``), and the CPU share of one core while every rank logs. Targets (the
issue's): a no-op cell on 1,024 nodes of 8 ranks under 50 ms of kernel CPU; 8,192 ranks'
metrics at 10 a second under one core.

Run: ``python benchmarks/bench_nodes.py [--nodes 128 1024] [--per-node 8]
[--layout auto|flat|tree] [--json PATH]``.
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
from nbddp._rank.relay import placed_relay  # noqa: E402
from nbddp._run.config import RunOptions  # noqa: E402
from nbddp._run.records import FolderPerCell  # noqa: E402
from nbddp._run.shape import GroupShape  # noqa: E402
from nbddp._run.waiting import WaitingGroup  # noqa: E402
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
METRICS_TARGET = 1.0  # of one core, 8,192 ranks at 10 steps/s
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

    def __init__(self, nodes: int, per_node: int, mode: str, tree: bool) -> None:
        super().__init__(RunOptions(nprocs=nodes * per_node, output="none").config(
            nodes * per_node))
        self.nodes, self.per_node, self.mode, self.tree = nodes, per_node, mode, tree

    def session_group(self, standby: bool = True) -> WaitingGroup:
        return SimulatedGroup(self.shape, self.nodes, self.per_node, self.mode, self.tree)

    def session_records(self) -> FolderPerCell:
        """A cluster session's records: a folder per cell (the ranks' logs are theirs to
        make, past ``MAKE_LOGS_UP_TO``)."""
        return FolderPerCell(self.config.nprocs)


def simulated_session(nodes: int, per_node: int, mode: str, layout: str = "auto"
                      ) -> nbddp.Session:
    """A session as ``nbddp.Session()`` makes one, on simulated nodes (``layout``: as
    ``--layout``)."""
    tree = layout == "tree" or (layout == "auto" and uses_tree(nodes))
    session = nbddp.Session.__new__(nbddp.Session)
    session._begin(SimulatedBackend(nodes, per_node, mode, tree))
    session._group = session._new_group()
    session._wait_ready()
    return session


def noop() -> None:
    """The no-op cell."""


def cpu_and_wall(fn: Callable[[], Any]) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def measure(nodes: int, per_node: int, opts: argparse.Namespace) -> dict[str, float]:
    figures: dict[str, float] = {}
    began = time.perf_counter()
    session = simulated_session(nodes, per_node, "noop", opts.layout)
    try:
        figures["start_s"] = time.perf_counter() - began
        for _ in range(3):
            session.run(noop)  # warm-up
        cells = [cpu_and_wall(lambda: session.run(noop)) for _ in range(opts.cells)]
        figures["cell_cpu_ms"] = 1000 * statistics.median(c for c, _ in cells)
        figures["cell_wall_ms"] = 1000 * statistics.median(w for _, w in cells)
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


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        host, port, key_file, first, count, per_node, mode, tree = sys.argv[2:]
        serve(host, int(port), key_file, int(first), int(count), int(per_node), mode,
              tree == "1")
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--cells", type=int, default=20, help="no-op cells per shape")
    parser.add_argument("--seconds", type=float, default=5.0, help="of metrics per shape")
    parser.add_argument("--rate", type=float, default=10.0, help="metric steps/s per rank")
    parser.add_argument("--layout", choices=("auto", "flat", "tree"), default="auto",
                        help="the relays: as a session places them, or all on the kernel's "
                             "link, or in a tree at any count")
    parser.add_argument("--json", type=Path, help="write the numbers to this file")
    opts = parser.parse_args()
    results: dict[str, Any] = {"machine": platform.node(), "cpus": os.cpu_count(),
                               "per_node": opts.per_node, "rate": opts.rate,
                               "layout": opts.layout}
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as tmp:
        os.environ["NBDDP_RUNS_DIR"] = str(Path(tmp) / "runs")  # keep the user's records
        print(f"{'nodes':>6} {'ranks':>6} {'start s':>8} {'cell CPU ms':>12} "
              f"{'cell wall ms':>13} {'metrics CPU':>12}")
        for nodes in opts.nodes:
            figures = measure(nodes, opts.per_node, opts)
            results[str(nodes)] = figures
            print(f"{nodes:>6} {nodes * opts.per_node:>6} {figures['start_s']:>8.1f} "
                  f"{figures['cell_cpu_ms']:>12.2f} {figures['cell_wall_ms']:>13.2f} "
                  f"{100 * figures['metrics_cpu_share']:>11.1f}%", flush=True)
    if opts.json:
        from bench_launch import write_json

        write_json(opts.json, results)


if __name__ == "__main__":
    main()
