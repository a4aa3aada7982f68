"""Benchmark the notebook's own modules shipped to a Ray session's nodes, through a kernel.

Starts a two-node Ray cluster on this machine (``bench_ray.LocalRayCluster``) and a real
Jupyter kernel whose folder holds 50 modules of about 40 KB each (2 MB of source), then
measures, each cell timed by the Jupyter client from the execute request to the kernel
going idle (what a person waits for), with shipping on and off (``NBDDP_SHIP_CODE=0``:
the nodes import from the folder they share with the kernel here), alternated:

1. **the first cell importing the 50 modules** on a new two-node session (their
   bytecode caches removed before each, as on nodes that never compiled them); target:
   at most 0.3 s more with shipping;
2. **a later cell that changes nothing** (``%%ddp`` with the modules imported), cells
   typed apart (``--gap`` seconds between them); target: no measurable difference, and
   the kernel's own CPU for the check (``RanksCode.changes``, timed in the kernel, also
   with autoreload's look at every file, and for a cell that imports the 50 again, which
   looks at theirs) under 0.1 ms;
3. **an edit of one module** (about 40 KB, 900 functions) with autoreload on: a cell
   reading its value right after the file was rewritten, against the same cell with no
   edit; target: at most 50 ms more. (The ranks reload it as a local session's would:
   most of the difference is IPython's reload of the module, on both nodes.)

Writes its record (``_record.py``: the machine, the commit, the load before it started,
the raw samples) to ``benchmarks/results/code_shipping-*.json``, or ``--json``; refuses
to start on a loaded machine unless ``--noisy``.
Run: ``python benchmarks/bench_code.py [--rounds N] [--cells N] [--noisy] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo, even on a GPU machine
os.environ["NBDDP_STANDBY"] = "0"  # nothing starting in the background while timing
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

from _record import Record, add_options  # noqa: E402
from bench_ray import LocalRayCluster  # noqa: E402
from bench_session import run_cell  # noqa: E402

MODULES = 50
MODULE_BYTES = 40_000
FIRST_TARGET = 0.3  # seconds more for the first cell with shipping
CHECK_TARGET = 1e-4  # seconds of kernel CPU per cell for the check
EDIT_TARGET = 0.050  # seconds more for the cell after an edit

NAMES = [f"shipped_{i:02d}" for i in range(MODULES)]
IMPORTS = "import " + ", ".join(NAMES)
START = "%ddp_session start --ray --nodes 2 --nprocs 1"
SHIPPING = {"on": "os.environ.pop('NBDDP_SHIP_CODE', None)",
            "off": "os.environ['NBDDP_SHIP_CODE'] = '0'"}


def write_modules(folder: Path) -> None:
    """50 modules of about 40 KB each: functions and a table, as a model file has."""
    for name in NAMES:
        body = [f'"""{name}: a module of the notebook\'s own."""', "VALUE = 0", ""]
        i = 0
        while sum(map(len, body)) < MODULE_BYTES:
            body += [f"def layer_{i}(x, scale={i}):", f"    return x * scale + {i}", ""]
            i += 1
        (folder / f"{name}.py").write_text("\n".join(body) + "\n")


def timed(client: Any, code: str, timeout: float = 300) -> float:
    start = time.perf_counter()
    run_cell(client, code, timeout)
    return time.perf_counter() - start


def first_cells(client: Any, folder: Path, rounds: int) -> dict[str, list[float]]:
    """The first cell importing the 50 modules on a new session, shipping on and off."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(rounds):
        for mode in ("on", "off"):
            for cache in folder.glob("__pycache__"):
                for file in cache.iterdir():
                    file.unlink()
            run_cell(client, SHIPPING[mode])
            run_cell(client, START, 300)
            times[mode].append(timed(client, f"%%ddp\n{IMPORTS}"))
            run_cell(client, "%ddp_session stop", 120)
    run_cell(client, SHIPPING["on"])
    return times


def later_cells(client: Any, cells: int, gap: float) -> dict[str, list[float]]:
    """A cell that changes nothing, shipping on and off alternated, typed ``gap`` apart."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(cells):
        for mode in ("on", "off"):
            run_cell(client, SHIPPING[mode])
            time.sleep(gap)
            times[mode].append(timed(client, "%%ddp\nshipped_07.VALUE"))
    run_cell(client, SHIPPING["on"])
    return times


CHECK_CELL = """
import time as _t
from nbddp._wire.users_code import imported_names as _imported_names
_group = _session._group
_samples = {{}}
for _kind, _names, _look in {kinds!r}:
    _names = _imported_names(_names)
    _runs = []
    for _ in range(500):
        _t0 = _t.thread_time()
        _group.code.changes(_names, _look)
        _runs.append(_t.thread_time() - _t0)
    _samples[_kind] = _runs
print("CHECK", repr(_samples))
"""

#: Each check timed: what it is, the cell whose import lines it is given, autoreload.
CHECK_KINDS = (("later cell, autoreload off", "shipped_07.VALUE", False),
               ("later cell, autoreload on", "shipped_07.VALUE", True),
               ("a cell importing the 50 again", IMPORTS, False))


def check_cost(client: Any) -> dict[str, list[float]]:
    """The kernel's CPU for one cell's check (``RanksCode.changes`` itself: what a cell
    with nothing changed adds), for each of ``CHECK_KINDS``, timed in the kernel."""
    said: list[str] = []

    def keep(msg: dict) -> None:
        if msg["msg_type"] == "stream":
            said.append(msg["content"]["text"])

    client.execute_interactive(CHECK_CELL.format(kinds=CHECK_KINDS), timeout=300,
                               output_hook=keep)
    text = "".join(said)
    return eval(text[text.index("CHECK") + 6:])  # noqa: S307 - our own repr


def edits(client: Any, folder: Path, rounds: int, gap: float) -> dict[str, list[float]]:
    """With autoreload on: the cell after one module was rewritten, and the same cell
    with nothing rewritten, alternated."""
    run_cell(client, "%ddp_session autoreload on")
    run_cell(client, "%%ddp\nshipped_07.VALUE")  # (the ranks note their modules' times)
    time.sleep(gap)
    times: dict[str, list[float]] = {"edited": [], "unchanged": []}
    for value in range(1, rounds + 1):
        for mode in ("edited", "unchanged"):
            if mode == "edited":
                text = (folder / "shipped_07.py").read_text()
                (folder / "shipped_07.py").write_text(
                    text.replace(f"VALUE = {value - 1}\n", f"VALUE = {value}\n", 1))
            time.sleep(gap)
            times[mode].append(timed(client, "%%ddp\nshipped_07.VALUE"))
    run_cell(client, "%ddp_session autoreload off")
    return times


def report(result: dict[str, Any], label: str) -> None:
    med = statistics.median
    first, later, check, edit = (result[k] for k in ("first_cell_s", "later_cell_s",
                                                     "check_cpu_s", "edit_cell_s"))
    more = med(first["on"]) - med(first["off"])
    print(f"\ncode shipping, two Ray nodes, {MODULES} modules ({MODULES * MODULE_BYTES / 1e6:.1f} "
          f"MB){label}")
    print(f"first cell importing them: {med(first['on']):.3f} s shipped, "
          f"{med(first['off']):.3f} s from the shared folder: {more:+.3f} s "
          f"(target <= +{FIRST_TARGET} s: {'met' if more <= FIRST_TARGET else 'MISSED'})")
    print(f"later cell, nothing changed: {med(later['on']) * 1e3:.2f} ms shipped, "
          f"{med(later['off']) * 1e3:.2f} ms not")
    for name, samples in check.items():
        cost = med(samples)
        verdict = "met" if cost < CHECK_TARGET else "MISSED"
        print(f"  kernel CPU for the check, {name}: {cost * 1e6:.1f} us "
              f"(target < {CHECK_TARGET * 1e6:.0f} us: {verdict})")
    extra = med(edit["edited"]) - med(edit["unchanged"])
    print(f"cell after an edit: {med(edit['edited']) * 1e3:.1f} ms, unchanged "
          f"{med(edit['unchanged']) * 1e3:.1f} ms: {extra * 1e3:+.1f} ms "
          f"(target <= +{EDIT_TARGET * 1e3:.0f} ms: {'met' if extra <= EDIT_TARGET else 'MISSED'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="first cells each (default 5)")
    parser.add_argument("--cells", type=int, default=40, help="later cells each (default 40)")
    parser.add_argument("--gap", type=float, default=1.5,
                        help="seconds between cells, as typed (default 1.5)")
    add_options(parser)
    opts = parser.parse_args()
    from jupyter_client.manager import start_new_kernel

    record = Record.start("code_shipping", opts)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as tmp, \
            LocalRayCluster(cpus=1) as cluster:
        folder = Path(tmp) / "notebook"
        folder.mkdir()
        write_modules(folder)
        env = {**os.environ, "NBDDP_RUNS_DIR": str(Path(tmp) / "runs")}
        manager, client = start_new_kernel(kernel_name="python3", cwd=str(folder), env=env)
        try:
            run_cell(client, f"import os\nos.environ['RAY_ADDRESS'] = {cluster.address!r}\n"
                             "import nbddp\n%load_ext nbddp", 120)
            print(f"first cells: {opts.rounds} each", flush=True)
            result["first_cell_s"] = first_cells(client, folder, opts.rounds)
            run_cell(client, START, 300)
            run_cell(client, f"%%ddp\n{IMPORTS}")
            run_cell(client, "_session = get_ipython().magics_manager.registry"
                             "['DDPMagics'].session")
            print(f"later cells: {opts.cells} each, {opts.gap} s apart", flush=True)
            result["later_cell_s"] = later_cells(client, opts.cells, opts.gap)
            result["check_cpu_s"] = check_cost(client)
            print(f"edits: {opts.cells // 2} each", flush=True)
            result["edit_cell_s"] = edits(client, folder, opts.cells // 2, opts.gap)
            run_cell(client, "%ddp_session stop", 120)
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=False)
    report(result, record.label)
    record.write(result)


if __name__ == "__main__":
    main()
