"""Benchmark the fast path kept for speed alone, on and off, through a real kernel.

One mechanism exists only to make a cell quicker: the relay's answer holding. It is
measured here as a notebook meets it: a real Jupyter kernel with a session of CPU ranks
(gloo), each timed cell from the execute request until the kernel is idle, typed
``--gap`` seconds after the one before. The sides alternate, ON OFF, OFF ON, ..., so that
a change in the machine's speed hits both alike. The figure is the share of the OFF
side's median that ON saves; the issue's bar is 5% (``met``) or the mechanism goes
(``MISSED``). Five more, held_calls, the plain-pickle quick cell, MAC copies, batch
scheduling and held functions, were measured by this script before their deletion
(records benchmarks/results/fast_paths-20261207-0219.json, -0226.json, -0232.json) and are
gone.

OFF is never a switch in nbddp's code: the function that implements the mechanism is
replaced, in the process that runs it, with one that takes the plain path and counts
that it was taken. Each ON cell must not have counted, or the run fails. What OFF means:

relay_holding (``_rank.relay``: a node's ends held until all its ranks said theirs)
    Only a relay has it, and a local session uses one only from 16 ranks where the
    machine has a core beside each: here a second session of ``--relay-ranks`` ranks
    (4, the cluster default) is made to use one (``cores.RELAY_FROM``,
    ``cores.usable_cores`` set in the kernel, as tests/test_many_ranks.py does). The
    relay runs in torchrun's process, where no cell runs: ``launcher.torchrun_command``
    is wrapped to start torchrun through a small script (written into the run's temp
    folder) that runs ``nbddp._torchrun`` unchanged, after installing a switch: SIGUSR1
    replaces ``GroupAnswers.awaited`` (which ``relay._more_wait`` asks) with one that
    says no rank is awaited, counting what the real one said; SIGUSR2 puts it back.
    Each switch writes the counts to a file, which this script reads: the patch is
    in place (or not) before each cell, and no ON cell asks the patched function. The
    relay asks only when a batch's first message is an end that merges and it can wait
    for more (ranks that end apart), so not every OFF cell reaches it: how many did,
    and how many would have held, is printed and kept. Workload: a trivial ``%%ddp``
    cell whose ranks' ends merge (``1 + 1``).

Every timed cell's value is checked on both sides. The record (``_record.py``) keeps
every sample, the order the sides ran in, and every check's counts.
Run: ``python benchmarks/bench_fast_paths.py [--rounds N] [--gap S] [--relay-ranks N]
[--noisy] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo, even on a GPU machine
os.environ["NBDDP_STANDBY"] = "0"  # nothing starting in the background while timing

from _record import Record, add_options  # noqa: E402
from bench_long_session import tree  # noqa: E402

TARGET = 5.0  # percent of the OFF side's median cell that ON saves: at least

RELAY_WRAPPER = '''"""nbddp's torchrun process (``python -m nbddp._torchrun ...``, unchanged)
with a switch for its relay's answer holding: SIGUSR1 turns it off (``GroupAnswers.awaited``
says no rank is awaited, counting what it would have said), SIGUSR2 on again. Each
switch writes the counts so far to relay-PID.json beside this file."""
import json
import os
import runpy
import signal
import sys
from pathlib import Path

from nbddp._rank.group_answers import GroupAnswers

HERE = Path(__file__).resolve().parent
AWAITED = GroupAnswers.awaited
STATE = {"seq": 0, "calls": 0, "would_hold": 0}


def _never_awaited(self):
    STATE["calls"] += 1
    if AWAITED(self):
        STATE["would_hold"] += 1
    return False


def _switch(signum, frame):
    said = dict(STATE)
    off = signum == signal.SIGUSR1
    GroupAnswers.awaited = _never_awaited if off else AWAITED
    STATE["seq"] += 1
    said.update(seq=STATE["seq"], now_off=off, stock=GroupAnswers.awaited is AWAITED)
    tmp = HERE / f"relay-{os.getpid()}.tmp"
    tmp.write_text(json.dumps(said))
    os.replace(tmp, HERE / f"relay-{os.getpid()}.json")


signal.signal(signal.SIGUSR1, _switch)
signal.signal(signal.SIGUSR2, _switch)
if sys.argv[1:3] != ["-m", "nbddp._torchrun"]:
    sys.exit(f"relay wrapper: unexpected command line {sys.argv}")
sys.argv = [sys.argv[0], *sys.argv[3:]]
sys.path[0] = os.getcwd()  # (as python -m puts it)
runpy.run_module("nbddp._torchrun", run_name="__main__", alter_sys=True)
'''

RELAY_SESSION = """from nbddp._local import cores as _fp_cores, launcher as _fp_launcher
_fp_cores.RELAY_FROM = {ranks}
_fp_cores.usable_cores = lambda: 64
_fp_command = _fp_launcher.torchrun_command
def _fp_wrapped(*args, **kwargs):
    command = _fp_command(*args, **kwargs)
    assert command[1:3] == ["-m", "nbddp._torchrun"], command
    return [command[0], {wrapper!r}, *command[1:]]
_fp_launcher.torchrun_command = _fp_wrapped
"""


WORKLOAD, EXPECTED = "%%ddp\n1 + 1", "2"
"""A trivial cell whose ranks' ends merge."""


class Failed(RuntimeError):
    """A cell failed, a value was wrong, or a patch did not take: the figure is void."""


class Kernel:
    """A Jupyter kernel and its client."""

    def __init__(self, manager: Any, client: Any) -> None:
        self.manager, self.client = manager, client
        self.pid: int = manager.provisioner.pid
        self.seen: dict[int, str] = {}  # every process started under it: its start time

    def run(self, code: str, timeout: float = 120,
            expressions: dict[str, str] | None = None) -> tuple[dict[str, Any], list[str]]:
        """Execute ``code``, wait until the kernel is idle; the reply and the values shown."""
        shown: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "execute_result":
                shown.append(msg["content"]["data"].get("text/plain", ""))

        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=hook,
                                                user_expressions=expressions or {})
        content = reply["content"]
        if content["status"] != "ok":
            raise Failed(f"cell failed: {code[:60]!r}: {content.get('ename')}: "
                         f"{content.get('evalue')}\n" + "\n".join(content.get("traceback", [])))
        return content, shown

    def timed(self, code: str, expected: str) -> float:
        """Seconds from the execute request until the kernel is idle; the value checked."""
        start = time.perf_counter()
        _, shown = self.run(code, 60)
        took = time.perf_counter() - start
        if shown != [expected]:
            raise Failed(f"{code!r} showed {shown}, not [{expected!r}]")
        return took

    def processes(self) -> set[int]:
        found = tree(self.pid)
        self.seen.update((pid, started) for pid in found if (started := _started(pid)))
        return found

    def left(self) -> list[int]:
        """Those of its processes still running (the same process: its start time)."""
        return [pid for pid, started in self.seen.items() if _started(pid) == started]


# --- the relay's answer holding: switched by a signal ------------------------------------


class RelaySwitch:
    """The switch in the relay's process (``RELAY_WRAPPER``)."""

    def __init__(self, k: Kernel, wrapper: Path) -> None:
        pids = [pid for pid in k.processes() if str(wrapper).encode()
                in _cmdline(pid)]
        if len(pids) != 1:
            raise Failed(f"relay: {len(pids)} torchrun processes through the wrapper")
        self.pid = pids[0]
        self.state = wrapper.parent / f"relay-{self.pid}.json"
        self.seq = 0

    def set(self, off: bool) -> dict[str, Any]:
        """The counts before, once the relay's process said it switched."""
        os.kill(self.pid, signal.SIGUSR1 if off else signal.SIGUSR2)
        self.seq += 1
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                said = json.loads(self.state.read_text())
                if said["seq"] == self.seq:
                    if said["now_off"] != off or said["stock"] == off:
                        raise Failed(f"relay: switched wrong: {said}")
                    return said
            time.sleep(0.002)
        raise Failed("relay: its process did not say it switched")


def _started(pid: int) -> str:
    """``pid``'s start time (``/proc``), or empty if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# --- timing ---------------------------------------------------------------------------


def alternate(rounds: int) -> list[str]:
    """ON OFF, OFF ON, ...: each round swaps which side goes first."""
    return [side for r in range(rounds) for side in (("on", "off") if r % 2 == 0
                                                      else ("off", "on"))]


def measure(k: Kernel, relay: RelaySwitch, rounds: int, gap: float,
            warm_up: int) -> dict[str, Any]:
    """``rounds`` cells each side, alternated, each ``gap`` s after its switch."""
    for side in alternate(warm_up):
        relay.set(side == "off")
        k.timed(WORKLOAD, EXPECTED)
    samples: dict[str, list[float]] = {"on": [], "off": []}
    order, verified = alternate(rounds), []
    before = relay.set(order[0] == "off")
    for i, side in enumerate(order):
        time.sleep(gap)
        samples[side].append(k.timed(WORKLOAD, EXPECTED))
        after = relay.set(i + 1 < len(order) and order[i + 1] == "off")
        calls = after["calls"] - before["calls"]
        if side == "on" and calls:
            raise Failed(f"relay: a timed ON cell asked the patched awaited {calls} times")
        verified.append({"side": side, "calls": calls,
                         "would_hold": after["would_hold"] - before["would_hold"]})
        before = after
    on, off = statistics.median(samples["on"]), statistics.median(samples["off"])
    paired = [o - n for n, o in zip(samples["on"], samples["off"], strict=True)]
    off_cells = [v for v in verified if v["side"] == "off"]
    result: dict[str, Any] = {
        "what": "the relay's answer holding", "workload": WORKLOAD, "expected": EXPECTED,
        "order": order, "samples_s": samples, "per_cell_checks": verified,
        "median_on_s": on, "median_off_s": off, "saved_s": off - on,
        "saved_pct": (off - on) / off * 100, "paired_median_saved_s": statistics.median(paired),
        "met": (off - on) / off * 100 >= TARGET,
        # (the relay asks only when a batch's first end came alone)
        "off_cells_asking": sum(1 for v in off_cells if v["calls"]),
        "off_cells_that_would_have_held": sum(1 for v in off_cells if v["would_hold"])}
    if not result["off_cells_asking"]:
        result["note"] = "the relay never asked whether to hold: ON and OFF ran the same code"
    return result


def start_kernel(cwd: Path, runs: Path) -> Kernel:
    from jupyter_client.manager import start_new_kernel

    env = {**os.environ, "NBDDP_RUNS_DIR": str(runs)}
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(cwd), env=env)
    return Kernel(manager, client)


def run_all(opts: argparse.Namespace, folder: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    k = start_kernel(folder, folder / "runs")
    try:
        k.run("%load_ext nbddp")
        wrapper = folder / "relay_wrapper.py"
        wrapper.write_text(RELAY_WRAPPER)
        k.run(RELAY_SESSION.format(ranks=opts.relay_ranks, wrapper=str(wrapper)))
        k.run(f"%ddp_session start --nprocs {opts.relay_ranks}", 300)
        _, shown = k.run("%%ddp\nimport os\nbool(os.environ.get('NBDDP_RELAY'))")
        if shown != ["True"]:
            raise Failed(f"relay: the ranks do not speak through a relay ({shown})")
        print(f"relay_holding ({opts.relay_ranks} ranks through a relay): {opts.rounds} "
              f"cells each side, {opts.gap} s apart", flush=True)
        try:
            results["relay_holding"] = measure(k, RelaySwitch(k, wrapper), opts.rounds,
                                               opts.gap, opts.warm_up)
            results["relay_holding"]["ranks"] = opts.relay_ranks
        except Failed as exc:
            print(f"  FAILED: {exc}", flush=True)
            results["relay_holding"] = {"what": "the relay's answer holding",
                                        "failed": str(exc)}
        print_one("relay_holding", results["relay_holding"], "")
        k.run("%ddp_session stop", 120)
    finally:
        k.client.stop_channels()
        k.manager.shutdown_kernel(now=False)
        deadline = time.monotonic() + 20
        while k.left() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in k.left():  # (nbddp's contract: none; said, and stopped)
            print(f"warning: process {pid} outlived the kernel; killing it", flush=True)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    return results


def print_one(name: str, r: dict[str, Any], label: str) -> None:
    if "failed" in r:
        print(f"  {name:16} FAILED: {r['failed'].splitlines()[0]}")
        return
    print(f"  {name:16} ON {r['median_on_s'] * 1000:7.2f} ms  OFF {r['median_off_s'] * 1000:7.2f}"
          f" ms  saves {r['saved_s'] * 1000:+7.2f} ms ({r['saved_pct']:+5.1f}%; paired "
          f"{r['paired_median_saved_s'] * 1000:+.2f} ms)  target >= {TARGET:.0f}%: "
          f"{'met' if r['met'] else 'MISSED'}{label}", flush=True)
    if "off_cells_asking" in r:
        print(f"  {'':16} OFF cells where the relay asked whether to hold: "
              f"{r['off_cells_asking']} of {len(r['samples_s']['off'])}; where it would "
              f"have held: {r['off_cells_that_would_have_held']}", flush=True)
    if "note" in r:
        print(f"  {'':16} note: {r['note']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25,
                        help="cells each side (default 25)")
    parser.add_argument("--gap", type=float, default=1.0,
                        help="seconds between a cell's toggle and the cell, as typed "
                             "(default 1.0)")
    parser.add_argument("--warm-up", type=int, default=2,
                        help="untimed rounds first (default 2)")
    parser.add_argument("--relay-ranks", type=int, default=4,
                        help="ranks of the relay's session (default 4)")
    add_options(parser)
    opts = parser.parse_args()
    record = Record.start("fast_paths", opts)
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as tmp:
        results = run_all(opts, Path(tmp))
    print(f"\nfast paths, ON against OFF, medians of {opts.rounds} cells each, "
          f"{opts.relay_ranks} CPU ranks (gloo) through a relay, cells {opts.gap} s "
          f"apart{record.label}:")
    for name, r in results.items():
        print_one(name, r, record.label)
    record.write({"nprocs": opts.relay_ranks, "target_saved_pct": TARGET,
                  "mechanisms": results})
    if any("failed" in r for r in results.values()):
        raise SystemExit("some mechanisms could not be measured: see FAILED above")


if __name__ == "__main__":
    main()
