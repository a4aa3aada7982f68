"""The peer in ``bench_scale.py --monarch PYTHON``: Monarch (``torchmonarch``), the
single-controller peer, on this host, measured as ``bench_scale.py`` measures nbddp's
session in a Python process: N processes spawned once (``this_host().spawn_procs``), one
actor each, then the wall time of a no-op endpoint called on every actor and of one
that all-reduces a tensor over gloo (the median of ``CELLS`` calls after a warm-up), and
the start (spawn, actors up, process group joined).

Run by ``bench_scale.py`` with the interpreter of an environment that has Monarch
(``pip install torchmonarch torch==2.13.0``: nbddp's own environment need not have it);
prints one JSON line per rank count: ``python peer_monarch.py CELLS N [N ...]``.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
from monarch.actor import Actor, current_rank, endpoint, this_host


class Rank(Actor):
    """One process's actor: joins a gloo group, then does nothing or all-reduces."""

    @endpoint
    def join(self, world_size: int, port: int) -> None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=current_rank().rank, world_size=world_size)

    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def all_reduce(self) -> float:
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        return float(tensor.item())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def median_ms(call, cells: int) -> float:
    for _ in range(5):
        call()  # warm-up
    times = []
    for _ in range(cells):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def shape(ranks: int, cells: int) -> dict[str, float]:
    began = time.perf_counter()
    procs = this_host().spawn_procs(per_host={"procs": ranks})
    actors = procs.spawn("rank", Rank)
    actors.join.call(ranks, free_port()).get()
    figures = {"ranks": ranks, "start_s": time.perf_counter() - began}
    figures["cell_wall_ms"] = median_ms(lambda: actors.noop.call().get(), cells)
    figures["all_reduce_wall_ms"] = median_ms(lambda: actors.all_reduce.call().get(), cells)
    procs.stop().get()
    return figures


def main() -> None:
    cells = int(sys.argv[1])
    for ranks in map(int, sys.argv[2:]):
        print(json.dumps(shape(ranks, cells)), flush=True)


if __name__ == "__main__":
    main()
