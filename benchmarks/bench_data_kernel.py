"""Benchmark the data plane through a real Jupyter kernel, as a notebook's user meets it.

A kernel started with ``jupyter_client`` defines a tensor in one cell and launches a
function that takes it in the next; the client times each launch cell from its execute
request to the kernel going idle. On 2 CPU ranks (gloo), standby ranks ready before
each launch, for 64 MiB, 1 GiB and 5 GiB of float32:

- **first send**: a tensor made in the cell before (new memory), against the same
  launch without it; beside each, the time of the cell that made the tensor (the
  notebook's own new memory, which this machine sometimes makes slow);
- **again**: the same unchanged tensor, right after a launch that sent it (its bytes
  are still in shared memory: nothing is copied);
- **changed**: the same tensor written in place in the notebook, then sent (a new copy);
- **result**: a launch returning a tensor of that size, against one that makes it on the
  ranks and returns nothing; and how much the kernel's memory grows at its peak while
  the launch brings back that result and the notebook reads every page of it;
- **session cells**: first send, again and changed as ``Session.run`` calls on one
  session's ranks, against a call that sends nothing.

Then, in the same kernel and many times over, **the steps of one send**, each timed on
its own with the functions a launch uses: the walk (pickling the payload, the tensor's
bytes left out of band), allocating its shared memory, the copy into it, and a reader
mapping the file and touching every page (what a rank does when it reads the tensor);
and the kept copy a launch makes instead (``kept copy``: a memory file allocated and
written) and the walk that finds it again (``kept again``).
The spread of those steps over the repeats is what says where a slow first send loses
its time.

Writes its record (``_record.py``) under ``benchmarks/results/``.
Run: ``python benchmarks/bench_data_kernel.py [--repeats N] [--sizes MiB,...] [--noisy]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _record import Record, add_options

MIB = 2**20
FIRST_TARGET = 0.6  # seconds a 1 GiB captured tensor may add, the first time
AGAIN_TARGET = 0.05  # ... sent again unchanged
RESULT_TARGET = 0.5  # ... returned
MEMORY_TARGET = 1.1  # GiB the kernel's memory may grow for a 1 GiB result

SETUP = r'''
import json, os, tempfile, time
from pathlib import Path
import torch, nbddp
from nbddp._wire import dataplane
from nbddp._wire.kept_storages import KeptStorages
from nbddp._wire.payload import Payload

def holds(data):
    return 0 if data is None else len(data)

def returns(n, send=True):
    made = torch.ones(n)
    return made if send else None

def ready():
    if nbddp.standby().status == "none":  # (a session took them: a launch starts more)
        nbddp.launch(holds, nprocs=2, args=(None,), backend="gloo", output="none")
    while nbddp.standby().status != "ready":
        time.sleep(0.1)
    time.sleep(1.0)  # the last run's ranks have exited, its rooms are allocated

def steps(n):
    """One send's steps, each on its own: walk, allocate, copy, map and touch."""
    data = torch.ones(n)
    folder = dataplane.shm_root() or Path(tempfile.gettempdir())
    times = {}
    start = time.perf_counter()
    packed = Payload.capture(holds, (data,), {}).dumps()
    times["walk"] = time.perf_counter() - start
    size, _ = dataplane.layout(packed)
    room = folder / f"nbddp-bench-room-{os.getpid()}"
    start = time.perf_counter()
    fd = os.open(room, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, size)
    os.close(fd)
    times["allocate"] = time.perf_counter() - start
    path = folder / f"nbddp-bench-{os.getpid()}"
    start = time.perf_counter()
    dataplane.write(path, packed, room)
    times["copy"] = time.perf_counter() - start
    start = time.perf_counter()
    mapped = Payload.unpack(dataplane.read(path)).args[0]
    float(mapped[::1024].sum())  # one float per page
    times["map and touch"] = time.perf_counter() - start
    del mapped
    path.unlink()
    kept = KeptStorages()
    start = time.perf_counter()
    Payload.capture(holds, (data,), {}).dumps(kept)
    times["kept copy"] = time.perf_counter() - start
    start = time.perf_counter()
    Payload.capture(holds, (data,), {}).dumps(kept)
    times["kept again"] = time.perf_counter() - start
    return times

def vm(field):
    """This process's memory figure ``field`` (/proc/self/status), in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def result_growth(n):
    """GiB the kernel's memory grows at its peak, a launch returning ``n`` floats and
    the notebook reading every page of them."""
    nbddp.launch(holds, nprocs=2, args=(None,), backend="gloo", output="none")
    ready()  # (the last result is gone: the last job, which held it, is another)
    Path("/proc/self/clear_refs").write_text("5")  # (the peak starts from here)
    before = vm("VmRSS")
    got = nbddp.launch(returns, nprocs=2, args=(n,), backend="gloo")
    float(got[::1024].sum())
    return (vm("VmHWM") - before) / 2**30

def session_cells(n, repeats):
    """Seconds a session cell sending ``n`` floats adds: the first time, again, changed."""
    session = nbddp.Session(2, backend="gloo", output="none")
    added = {"first send": [], "again": [], "changed": []}
    def timed(*args):
        start = time.perf_counter()
        session.run(holds, *args)
        return time.perf_counter() - start
    try:
        for _ in range(repeats):
            base = min(timed(None) for _ in range(3))
            data = torch.ones(n)
            added["first send"].append(timed(data) - base)
            added["again"].append(timed(data) - base)
            data.add_(1)
            added["changed"].append(timed(data) - base)
            del data
    finally:
        session.close()
    return added
'''


class Kernel:
    """A Jupyter kernel and its client; ``run`` executes a cell and times it."""

    def __init__(self, cwd: str) -> None:
        from jupyter_client.manager import start_new_kernel

        env = {**os.environ, "NBDDP_DISPLAY": "text"}
        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=cwd, env=env)

    def run(self, code: str, timeout: float = 600) -> tuple[float, str]:
        """The cell's wall time as the client sees it, and what it printed."""
        printed: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream":
                printed.append(msg["content"]["text"])

        start = time.perf_counter()
        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=hook)
        elapsed = time.perf_counter() - start
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"the cell failed: {code}\n{reply['content']}\n{''.join(printed)}")
        return elapsed, "".join(printed)

    def launch(self, call: str) -> float:
        """Time of a launch cell on ready standby ranks (made ready in an untimed cell)."""
        self.run("ready()")
        return self.run(f"nbddp.launch({call}, nprocs=2, backend='gloo');")[0]

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=False)


def launches(kernel: Kernel, size_mib: int, repeats: int,
             making: list[float]) -> dict[str, list[float]]:
    """Added seconds per repeat: first send, again, result; ``making`` gets the seconds of
    each cell that made the tensor a first send sends (the notebook's own new memory,
    the price of which this machine changes over time)."""
    n = size_mib * MIB // 4
    added: dict[str, list[float]] = {"first send": [], "again": [], "changed": [],
                                     "result": []}
    for _ in range(repeats):
        base = kernel.launch("holds, args=(None,)")
        making.append(kernel.run(f"data = torch.ones({n})")[0])
        added["first send"].append(kernel.launch("holds, args=(data,)") - base)
        added["again"].append(kernel.launch("holds, args=(data,)") - base)
        kernel.run("data += 1")
        added["changed"].append(kernel.launch("holds, args=(data,)") - base)
        kernel.run("del data")
        made = kernel.launch(f"returns, args=({n}, False)")
        kernel.launch(f"returns, args=({n},)")  # (the result's room is made ahead after)
        added["result"].append(kernel.launch(f"returns, args=({n},)") - made)
    return added


def result_memory(kernel: Kernel, size_mib: int, repeats: int) -> list[float]:
    """GiB the kernel's memory grows at its peak for a result of ``size_mib``."""
    n = size_mib * MIB // 4
    out = kernel.run(f"print(json.dumps([result_growth({n}) for _ in range({repeats})]))")[1]
    return json.loads(out.strip().splitlines()[-1])


def session_added(kernel: Kernel, size_mib: int, repeats: int) -> dict[str, list[float]]:
    """Added seconds per session cell: first send, again, changed."""
    n = size_mib * MIB // 4
    kernel.run("ready()")
    out = kernel.run(f"print(json.dumps(session_cells({n}, {repeats})))")[1]
    return json.loads(out.strip().splitlines()[-1])


def send_steps(kernel: Kernel, size_mib: int, repeats: int) -> dict[str, list[float]]:
    """Each step of one send, ``repeats`` times, in the kernel."""
    n = size_mib * MIB // 4
    out = kernel.run(f"print(json.dumps([steps({n}) for _ in range({repeats})]))")[1]
    rows = json.loads(out.strip().splitlines()[-1])
    return {name: [row[name] for row in rows] for name in rows[0]}


def _spread(values: list[float]) -> str:
    return (f"{statistics.median(values):+.3f} s (min {min(values):+.3f}, "
            f"max {max(values):+.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="launches per figure")
    parser.add_argument("--steps", type=int, default=10, help="timed sends, step by step")
    parser.add_argument("--sizes", default="64,1024,5120", help="MiB, comma-separated")
    add_options(parser)
    opts = parser.parse_args()
    sizes = [int(s) for s in opts.sizes.split(",")]
    record = Record.start("data_kernel", opts)
    result: dict[str, Any] = {"repeats": opts.repeats, "cpus": os.cpu_count(), "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as tmp:
        os.environ["NBDDP_RUNS_DIR"] = str(Path(tmp) / "runs")
        kernel = Kernel(tmp)
        try:
            kernel.run(SETUP + "\nnbddp.standby(True)\nnbddp.launch(holds, nprocs=2, "
                       "args=(None,), backend='gloo');", timeout=180)
            for size in sizes:
                print(f"{size} MiB through the kernel:", flush=True)
                made: list[float] = []
                added = launches(kernel, size, opts.repeats, made)
                for name, values in added.items():
                    print(f"  {name:12} {_spread(values)}", flush=True)
                print("  each first send, and the cell that made its tensor: " + ", ".join(
                    f"{sent:+.2f} s ({making:.2f} s)"
                    for sent, making in zip(added["first send"], made, strict=True)), flush=True)
                grown = result_memory(kernel, size, opts.repeats)
                print(f"  result: the kernel's memory grew {statistics.median(grown):.2f} GiB "
                      f"at its peak (max {max(grown):.2f})", flush=True)
                cells = session_added(kernel, size, opts.repeats)
                for name, values in cells.items():
                    print(f"  session {name:12} {_spread(values)}", flush=True)
                parts = send_steps(kernel, size, opts.steps)
                print("  one send, step by step, " + "; ".join(
                    f"{name} {statistics.median(v):.3f} s ({min(v):.3f}-{max(v):.3f})"
                    for name, v in parts.items()), flush=True)
                result["sizes"][size] = {"added_s": added, "made_s": made,
                                         "result_memory_gib": grown,
                                         "session_added_s": cells, "steps_s": parts}
            kernel.run("nbddp.standby(False)")
        finally:
            kernel.close()
    gib = result["sizes"].get(1024)
    if gib:
        print(f"\n1 GiB figures{record.label}:")
        for name, target in (("first send", FIRST_TARGET), ("again", AGAIN_TARGET),
                             ("result", RESULT_TARGET)):
            value = statistics.median(gib["added_s"][name])
            print(f"1 GiB {name}: {value:+.3f} s, target <= {target}: "
                  f"{'met' if value <= target else 'MISSED'}")
        worst = max(gib["added_s"]["first send"])
        print(f"1 GiB first send, every time: at most {worst:+.3f} s, target <= "
              f"{FIRST_TARGET}: {'met' if worst <= FIRST_TARGET else 'MISSED'}")
        again = statistics.median(gib["session_added_s"]["again"])
        print(f"1 GiB again in a session cell: {again:+.3f} s, target <= {AGAIN_TARGET}: "
              f"{'met' if again <= AGAIN_TARGET else 'MISSED'}")
        grown = statistics.median(gib["result_memory_gib"])
        print(f"1 GiB result: the kernel grew {grown:.2f} GiB, target <= {MEMORY_TARGET}: "
              f"{'met' if grown <= MEMORY_TARGET else 'MISSED'}")
    record.write(result)


if __name__ == "__main__":
    main()
