"""Benchmark the data plane: tensors to the ranks and back, out of band, mapped.

On 2 CPU ranks, launches on standby ranks (so that start-up does not hide the data's
cost), each after the standby group is ready:

- the time a captured tensor of 64 MiB, 1 GiB and 5 GiB adds to a launch, against the
  same launch without it: the first time (after a launch that sent nothing) and again
  (after a launch that sent as much, so shared memory was allocated ahead), and the same
  for a result of that size (against making it on the ranks and returning nothing):
  effective GB/s both ways;
- what a captured 1 GiB tensor adds to a cold launch (standby off), where writing it
  overlaps torchrun's start;
- each rank's memory after reading a captured 1 GiB tensor: resident, proportional
  (PSS: shared pages counted once) and private;
- the kernel's peak memory growth while it receives a 1 GiB result (in a fresh process
  of its own, so the peak is that launch's).

Writes its record (``_record.py``, every launch's time among its samples) under
``benchmarks/results/``.
Run: ``python benchmarks/bench_data.py [--repeats N] [--sizes MiB,...] [--noisy]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo, even on a GPU machine

import torch  # noqa: E402
from _record import Record, add_options  # noqa: E402

import nbddp  # noqa: E402

MIB = 2**20
CAPTURE_TARGET = 0.3  # seconds a 1 GiB captured tensor may add to a launch
RESULT_TARGET = 0.5  # seconds a 1 GiB result may add
PEAK_TARGET = 1.1  # GiB the kernel's memory may grow by while receiving a 1 GiB result
LAUNCHES: list[dict] = []
"""Every timed launch: what it ran, on what, after what, and its seconds (the samples
behind each median)."""


def reads(data: torch.Tensor | None) -> float:
    """Touch every page of ``data`` (a sum of one element per page)."""
    return 0.0 if data is None else float(data[:: 4096 // data.element_size()].sum())


def holds(data: torch.Tensor | None) -> int:
    """On a rank: take the captured tensor without reading it."""
    return 0 if data is None else len(data)


def returns(nbytes: int, send: bool = True) -> torch.Tensor | None:
    """On a rank: make ``nbytes`` of data, and return it if ``send``."""
    made = torch.ones(nbytes, dtype=torch.uint8)
    return made if send else None


def memory_after_reading(data: torch.Tensor) -> dict[str, float]:
    """On a rank: its memory in MiB once it has read every page of ``data``."""
    reads(data)
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Pss", "Private_Clean", "Private_Dirty"):
            fields[name] = int(rest.split()[0]) / 1024
    return {"rss": fields["Rss"], "pss": fields["Pss"],
            "private": fields["Private_Clean"] + fields["Private_Dirty"]}


def launch(fn, *args, warm: bool = True) -> float:
    """Wall time of one launch: on ready standby ranks, or (``warm=False``) cold."""
    if warm:
        while nbddp.standby().status != "ready":
            time.sleep(0.1)
        time.sleep(1.0)  # the last run's ranks have exited, its data is allocated ahead
    start = time.perf_counter()
    job = nbddp.launch(fn, 2, args=args, wait=False, backend="gloo")
    job.result()
    elapsed = time.perf_counter() - start
    if job.warm != warm:
        raise RuntimeError(f"the launch was {'warm' if job.warm else 'cold'}, not as asked")
    return elapsed


def timed(repeats: int, fn, *args, after=None) -> float:
    """Median time of a warm launch of ``fn(*args)``, each after a launch of ``after``
    (args for ``fn``), when given: what the previous cell sent decides whether shared
    memory was allocated ahead."""
    times = []
    for _ in range(repeats):
        if after is not None:
            launch(fn, *after)
        times.append(launch(fn, *args))
    LAUNCHES.append({"fn": fn.__name__, "args": _described(args),
                     "after": None if after is None else _described(after),
                     "warm": True, "seconds": times})
    return statistics.median(times)


def _described(args: tuple) -> list:
    """A launch's arguments as the record keeps them: a tensor by its size."""
    return [f"tensor of {a.nbytes} bytes" if isinstance(a, torch.Tensor) else a
            for a in args]


def throughput(sizes_mib: list[int], repeats: int) -> dict:
    """Added seconds and GB/s of a captured tensor and of a result, per size."""
    base = timed(repeats, holds, None)
    rows: dict[int, dict[str, float]] = {}
    for size in sizes_mib:
        nbytes = size * MIB
        data = torch.ones(nbytes, dtype=torch.uint8)
        first = timed(repeats, holds, data, after=(None,)) - base
        again = timed(repeats, holds, data, after=(data,)) - base
        read = timed(repeats, reads, data, after=(data,)) - base
        del data
        made = timed(repeats, returns, nbytes, False)  # made on the ranks, not sent
        result = timed(repeats, returns, nbytes, after=(nbytes,)) - made
        result_first = timed(repeats, returns, nbytes, after=(nbytes, False)) - made
        rows[size] = {"capture_added_s": again, "to_ranks_gb_s": nbytes / 1e9 / again,
                      "first_capture_added_s": first,
                      "first_to_ranks_gb_s": nbytes / 1e9 / first,
                      "capture_and_read_added_s": read,
                      "result_added_s": result, "from_ranks_gb_s": nbytes / 1e9 / result,
                      "first_result_added_s": result_first,
                      "first_from_ranks_gb_s": nbytes / 1e9 / result_first}
        print(f"  {size:6} MiB: captured {_added(again, nbytes)} again, "
              f"{_added(first, nbytes)} the first time, {_added(read, nbytes)} again if "
              f"every rank reads every page; returned {_added(result, nbytes)} again, "
              f"{_added(result_first, nbytes)} the first time", flush=True)
    return {"base_launch_s": base, "sizes": rows}


def _added(seconds: float, nbytes: int) -> str:
    """Added time and what it means in GB/s (none measurable: within the noise)."""
    if seconds <= 0:
        return f"{seconds:+.3f} s (within noise)"
    return f"+{seconds:.3f} s ({nbytes / 1e9 / seconds:.2f} GB/s)"


def cold(repeats: int, size_mib: int) -> dict:
    """What a captured tensor adds to a cold launch (its write overlaps torchrun's
    start)."""
    data = torch.ones(size_mib * MIB, dtype=torch.uint8)
    bases = [launch(holds, None, warm=False) for _ in range(repeats)]
    with_datas = [launch(holds, data, warm=False) for _ in range(repeats)]
    base, with_data = statistics.median(bases), statistics.median(with_datas)
    for args, times in (((None,), bases), ((data,), with_datas)):
        LAUNCHES.append({"fn": "holds", "args": _described(args), "after": None,
                         "warm": False, "seconds": times})
    print(f"  cold launch {base:.3f} s; with {size_mib} MiB captured {with_data:.3f} s "
          f"(+{with_data - base:.3f} s)", flush=True)
    return {"size_mib": size_mib, "base_s": base, "with_data_s": with_data,
            "added_s": with_data - base}


def rank_memory() -> list[dict[str, float]]:
    data = torch.ones(1024 * MIB, dtype=torch.uint8)
    return nbddp.launch(memory_after_reading, 2, args=(data,), all_ranks=True)


def kernel_peak() -> float:
    """GiB the kernel grows by, at its peak, receiving a 1 GiB result (own process)."""
    # VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's peak (this
    # benchmark's, after its 5 GiB tensors); VmHWM is the new process's own.
    code = ("import re, sys, nbddp; sys.path.insert(0, sys.argv[1]); import bench_data as b; "
            "hwm = lambda: re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())"
            ".group(1); before = hwm(); value = nbddp.launch(b.returns, 2, args=(2**30,), "
            "backend='gloo'); b.reads(value); print(before, hwm())")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)],
                          capture_output=True, text=True, check=True,
                          env={**os.environ, "NBDDP_STANDBY": "0", "NBDDP_DISPLAY": "text"})
    before, after = (int(kib) for kib in done.stdout.strip().splitlines()[-1].split())
    print(f"  kernel peak RSS {before / 2**20:.2f} GiB before, {after / 2**20:.2f} GiB after",
          flush=True)
    return (after - before) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="launches per figure")
    parser.add_argument("--sizes", default="64,1024,5120", help="MiB, comma-separated")
    add_options(parser)
    opts = parser.parse_args()
    sizes = [int(s) for s in opts.sizes.split(",")]
    record = Record.start("data", opts)
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as tmp:
        os.environ["NBDDP_RUNS_DIR"] = str(Path(tmp) / "runs")
        os.environ["NBDDP_DISPLAY"] = "text"
        nbddp.standby(True)
        try:
            nbddp.launch(holds, 2, args=(None,), backend="gloo")  # starts standby ranks
            print("captured tensors and results, added to a warm launch:", flush=True)
            moved = throughput(sizes, opts.repeats)
            memory = rank_memory()
        finally:
            nbddp.standby(False)
        print("captured, added to a cold launch (standby off):", flush=True)
        cold_launch = cold(opts.repeats, 1024)
        peak = kernel_peak()
    gib = moved["sizes"].get(1024, {})
    result = {"repeats": opts.repeats, "cpus": os.cpu_count(), "torch": torch.__version__,
              "throughput": moved, "cold": cold_launch,
              "rank_memory_mib_after_reading_1gib": memory,
              "kernel_peak_growth_gib_for_1gib_result": peak,
              "targets": {"capture_1gib_s": CAPTURE_TARGET, "result_1gib_s": RESULT_TARGET,
                          "kernel_peak_gib": PEAK_TARGET},
              "launches_s": LAUNCHES}
    print("\neach rank after reading a captured 1 GiB tensor: " + "; ".join(
        f"rank {r}: RSS {m['rss']:.0f} MiB, PSS {m['pss']:.0f} MiB, private "
        f"{m['private']:.0f} MiB" for r, m in enumerate(memory)))
    print(f"kernel peak growth receiving a 1 GiB result: {peak:.2f} GiB "
          f"(target <= {PEAK_TARGET}){record.label}")
    if gib:
        print(f"1 GiB captured: +{gib['capture_added_s']:.3f} s warm, the same data again; "
              f"+{gib['first_capture_added_s']:.3f} s warm, new data; "
              f"+{cold_launch['added_s']:.3f} s cold (target <= {CAPTURE_TARGET}); "
              f"1 GiB result: +{gib['result_added_s']:.3f} s again, "
              f"+{gib['first_result_added_s']:.3f} s the first time (target <= "
              f"{RESULT_TARGET})")
    record.write(result)


if __name__ == "__main__":
    main()
