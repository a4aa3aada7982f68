"""Benchmark the fast paths kept for speed alone: each one on and off, through a real kernel.

Two mechanisms exist only to make a cell or a call quicker. Each is measured here as a
notebook meets it: a real Jupyter kernel with a session of 2 CPU ranks (gloo), each
timed cell from the execute request until the kernel is idle, typed ``--gap`` seconds
after the one before. The sides alternate, ON OFF, OFF ON, ..., so that a change in the
machine's speed hits both alike. The figure is the share of the OFF side's median that
ON saves; the issue's bar is 5% (``met``) or the mechanism goes (``MISSED``). Four more,
held_calls, the plain-pickle quick cell, MAC copies and batch scheduling, were measured by
this script before their deletion (records benchmarks/results/fast_paths-20261207-0219.json,
-0226.json, -0232.json) and are gone.

OFF is never a switch in nbddp's code: the module attribute that implements the
mechanism is replaced, in the kernel and (by a ``Session.run_all`` of a toggle before
each timed cell) in each rank, with one that takes the plain path, and counts that it
was taken. Each OFF cell must have counted, each ON cell must not (less what the toggle
run itself counts, measured before timing), or the run fails. What OFF means:

held_functions (``_wire.held_functions``, notebook functions sent by number)
    ``RanksFunctions.held`` and ``RanksFunctions.number_for`` (methods the kernel's
    ``TensorPickler._function`` calls) made to return None in the kernel: a notebook
    function then goes as cloudpickle's own reduction, by value, every call, as it did
    before the ranks held functions. Workload: a cell ``session.run(f, 10)`` of a
    five-line notebook function.
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
Run: ``python benchmarks/bench_fast_paths.py [--rounds N] [--gap S] [--only NAMES]
[--noisy] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks with gloo, even on a GPU machine
os.environ["NBDDP_STANDBY"] = "0"  # nothing starting in the background while timing

from _record import Record, add_options  # noqa: E402
from bench_long_session import tree  # noqa: E402

TARGET = 5.0  # percent of the OFF side's median cell that ON saves: at least
NPROCS = 2

HELPER = r'''
"""The benchmark's switches: the same module in the kernel and in each rank."""
from nbddp._wire import held_functions

COUNT = {"held_functions": 0, "by_number": 0}
ORIG = {"held": held_functions.RanksFunctions.held,
        "number_for": held_functions.RanksFunctions.number_for,
        "by_number": held_functions.by_number}


def _never_held(self, fn):
    COUNT["held_functions"] += 1
    return None


def _no_number(self, fn):
    return None


def _probe_by_number(*args):
    COUNT["by_number"] += 1
    return ORIG["by_number"](*args)


def toggle(name, setting):
    """The counts so far; then ``name`` set ON (False), OFF (True), or to record what
    the stock path does ("probe"); None: only the counts."""
    said = dict(COUNT)
    if setting is None:
        return said
    off = setting is True
    if name == "held_functions":
        functions = held_functions.RanksFunctions
        held_functions.by_number = (_probe_by_number if setting == "probe"
                                    else ORIG["by_number"])
        functions.held = _never_held if off else ORIG["held"]
        functions.number_for = _no_number if off else ORIG["number_for"]
    return said
'''

KERNEL_SETUP = """import sys, types
_fp_src = {helper!r}
_fb = types.ModuleType("_fastbench_helper")
exec(_fp_src, _fb.__dict__)
sys.modules["_fastbench_helper"] = _fb
%load_ext nbddp
"""

SESSION_SETUP = """_fp_session = get_ipython().magics_manager.registry["DDPMagics"].session
def _fp_rank(source, name, setting):
    import sys, types
    helper = sys.modules.get("_fastbench_helper")
    if helper is None:
        helper = types.ModuleType("_fastbench_helper")
        exec(source, helper.__dict__)
        sys.modules["_fastbench_helper"] = helper
    return helper.toggle(name, setting)
def _fp_call(n):
    total = 0
    for i in range(n):
        total += i * i
    return total
_fp_session.run_all(_fp_rank, _fp_src, "none", None)
"""

TOGGLE = """_fp_out = {{"kernel_before": _fb.toggle({name!r}, None)}}
_fb.toggle({name!r}, {setting!r})
_fp_out["ranks_before"] = _fp_session.run_all(_fp_rank, None, {name!r}, {setting!r})
_fp_out["kernel_after"] = _fb.toggle({name!r}, None)
"""

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


@dataclass(frozen=True)
class Mechanism:
    name: str
    what: str
    workload: str
    expected: str
    how: str = "cell"  # cell: toggled by a kernel cell; relay: by a signal


MECHANISMS = [
    Mechanism("held_functions", "held functions (Session.run)",
              "_fp_session.run(_fp_call, 10)", "285"),
    Mechanism("relay_holding", "the relay's answer holding", "%%ddp\n1 + 1", "2", how="relay"),
]


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

    def toggle(self, name: str, setting: bool | str | None) -> dict[str, Any]:
        """Set ``name`` in the kernel and every rank; the counts before (kernel and
        ranks) and the kernel's after."""
        content, _ = self.run(TOGGLE.format(name=name, setting=setting),
                              expressions={"out": "_fp_out"})
        said = content["user_expressions"]["out"]
        if said.get("status") != "ok":
            raise Failed(f"toggle {name}: {said}")
        return ast.literal_eval(said["data"]["text/plain"])

    def processes(self) -> set[int]:
        found = tree(self.pid)
        self.seen.update((pid, started) for pid in found if (started := _started(pid)))
        return found

    def left(self) -> list[int]:
        """Those of its processes still running (the same process: its start time)."""
        return [pid for pid, started in self.seen.items() if _started(pid) == started]


# --- a mechanism toggled by a cell ------------------------------------------------------


def counted(before: dict[str, Any], after: dict[str, Any], before_ranks: list[dict[str, Any]],
            after_ranks: list[dict[str, Any]], key: str) -> tuple[int, list[int]]:
    return (after[key] - before[key],
            [a[key] - b[key] for a, b in zip(after_ranks, before_ranks, strict=True)])


def cell_counts(k: Kernel, mech: Mechanism, setting: bool | str,
                key: str) -> dict[str, Any]:
    """What one workload cell counts under ``setting``, in the kernel and on each rank,
    less what a toggle run itself counts on the ranks (its report)."""
    a = k.toggle(mech.name, setting)
    b = k.toggle(mech.name, setting)
    k.timed(mech.workload, mech.expected)
    c = k.toggle(mech.name, setting)
    _, tail = counted(a["kernel_after"], b["kernel_before"], a["ranks_before"],
                      b["ranks_before"], key)
    kernel, ranks = counted(b["kernel_after"], c["kernel_before"], b["ranks_before"],
                            c["ranks_before"], key)
    return {"kernel": kernel, "ranks": [r - t for r, t in zip(ranks, tail, strict=True)],
            "toggle_tail": tail}


def preflight(k: Kernel, mech: Mechanism) -> dict[str, Any]:
    """Before timing: the OFF patch is taken by the workload (and counts), and ON is the
    fast path (where that can be seen)."""
    checks: dict[str, Any] = {}
    off = checks["off"] = cell_counts(k, mech, True, mech.name)
    problems = []
    if off["kernel"] <= 0:
        problems.append(f"the kernel took no OFF path ({off})")
    if mech.name == "held_functions":
        k.toggle(mech.name, False)
        k.timed(mech.workload, mech.expected)  # (taught, if it was not)
        probe = checks["on_by_number"] = cell_counts(k, mech, "probe", "by_number")
        if probe["kernel"] <= 0:
            problems.append(f"ON does not send the function by number ({probe})")
    k.toggle(mech.name, False)
    if problems:
        raise Failed(f"{mech.name}: " + "; ".join(problems))
    return checks


def check_sample(mech: Mechanism, side: str, before: dict[str, Any], after: dict[str, Any],
                 tail: list[int]) -> dict[str, Any]:
    """The counts of one timed cell (between its toggle and the next): none ON, some OFF."""
    kernel, ranks = counted(before["kernel_after"], after["kernel_before"],
                            before["ranks_before"], after["ranks_before"], mech.name)
    if side == "off":
        ranks = [r - t for r, t in zip(ranks, tail, strict=True)]
        bad = kernel <= 0
    else:
        bad = kernel != 0 or any(ranks)
    if bad:
        raise Failed(f"{mech.name}: a timed {side.upper()} cell counted kernel {kernel}, "
                     f"ranks {ranks}: the patch did not hold")
    return {"side": side, "kernel": kernel, "ranks": ranks}


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


def measure(k: Kernel, mech: Mechanism, rounds: int, gap: float, warm_up: int,
            relay: RelaySwitch | None = None) -> dict[str, Any]:
    """``rounds`` cells each side, alternated, each ``gap`` s after its toggle."""
    result: dict[str, Any] = {"what": mech.what, "workload": mech.workload,
                              "expected": mech.expected}
    if mech.how == "cell":
        checks = preflight(k, mech)
        tail = checks["off"]["toggle_tail"]
        set_side = lambda side: k.toggle(mech.name, side == "off")  # noqa: E731
    else:
        assert relay is not None
        checks = {}
        set_side = lambda side: relay.set(side == "off")  # noqa: E731
    for side in alternate(warm_up):
        set_side(side)
        k.timed(mech.workload, mech.expected)
    samples: dict[str, list[float]] = {"on": [], "off": []}
    order, verified = alternate(rounds), []
    before = set_side(order[0])
    for i, side in enumerate(order):
        time.sleep(gap)
        samples[side].append(k.timed(mech.workload, mech.expected))
        after = set_side(order[i + 1] if i + 1 < len(order) else "on")
        if mech.how == "cell":
            verified.append(check_sample(mech, side, before, after, tail))
        else:
            calls = after["calls"] - before["calls"]
            if side == "on" and calls:
                raise Failed(f"relay: a timed ON cell asked the patched awaited {calls} times")
            verified.append({"side": side, "calls": calls,
                             "would_hold": after["would_hold"] - before["would_hold"]})
        before = after
    on, off = statistics.median(samples["on"]), statistics.median(samples["off"])
    paired = [o - n for n, o in zip(samples["on"], samples["off"], strict=True)]
    result.update(checks=checks, order=order, samples_s=samples, per_cell_checks=verified,
                  median_on_s=on, median_off_s=off, saved_s=off - on,
                  saved_pct=(off - on) / off * 100, paired_median_saved_s=statistics.median(paired),
                  met=(off - on) / off * 100 >= TARGET)
    if mech.how == "relay":  # (the relay asks only when a batch's first end came alone)
        off_cells = [v for v in verified if v["side"] == "off"]
        result["off_cells_asking"] = sum(1 for v in off_cells if v["calls"])
        result["off_cells_that_would_have_held"] = sum(1 for v in off_cells if v["would_hold"])
        if not result["off_cells_asking"]:
            result["note"] = ("the relay never asked whether to hold: ON and OFF ran the "
                              "same code")
    return result


def start_kernel(cwd: Path, runs: Path) -> Kernel:
    from jupyter_client.manager import start_new_kernel

    env = {**os.environ, "NBDDP_RUNS_DIR": str(runs)}
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(cwd), env=env)
    return Kernel(manager, client)


def run_all(opts: argparse.Namespace, folder: Path) -> dict[str, Any]:
    chosen = [m for m in MECHANISMS if not opts.only or m.name in opts.only]
    results: dict[str, Any] = {}
    k = start_kernel(folder, folder / "runs")
    try:
        k.run(KERNEL_SETUP.format(helper=HELPER))
        main = [m for m in chosen if m.how != "relay"]
        if main:
            k.run(f"%ddp_session start --nprocs {NPROCS}", 300)
            k.run(SESSION_SETUP)
            k.processes()
            for mech in main:
                print(f"{mech.name}: {opts.rounds} cells each side, {opts.gap} s apart",
                      flush=True)
                try:
                    results[mech.name] = measure(k, mech, opts.rounds, opts.gap, opts.warm_up)
                except Failed as exc:
                    print(f"  FAILED: {exc}", flush=True)
                    results[mech.name] = {"what": mech.what, "failed": str(exc)}
                    if mech.how == "cell":
                        k.toggle(mech.name, False)
                print_one(mech.name, results[mech.name], "")
            k.run("%ddp_session stop", 120)
        relay = [m for m in chosen if m.how == "relay"]
        if relay:
            wrapper = folder / "relay_wrapper.py"
            wrapper.write_text(RELAY_WRAPPER)
            k.run(RELAY_SESSION.format(ranks=opts.relay_ranks, wrapper=str(wrapper)))
            k.run(f"%ddp_session start --nprocs {opts.relay_ranks}", 300)
            k.run(SESSION_SETUP)
            _, shown = k.run("%%ddp\nimport os\nbool(os.environ.get('NBDDP_RELAY'))")
            if shown != ["True"]:
                raise Failed(f"relay: the ranks do not speak through a relay ({shown})")
            mech = relay[0]
            print(f"{mech.name} ({opts.relay_ranks} ranks through a relay): {opts.rounds} "
                  f"cells each side, {opts.gap} s apart", flush=True)
            try:
                results[mech.name] = measure(k, mech, opts.rounds, opts.gap, opts.warm_up,
                                             RelaySwitch(k, wrapper))
                results[mech.name]["ranks"] = opts.relay_ranks
            except Failed as exc:
                print(f"  FAILED: {exc}", flush=True)
                results[mech.name] = {"what": mech.what, "failed": str(exc)}
            print_one(mech.name, results[mech.name], "")
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
                        help="cells each side, per mechanism (default 25)")
    parser.add_argument("--gap", type=float, default=1.0,
                        help="seconds between a cell's toggle and the cell, as typed "
                             "(default 1.0)")
    parser.add_argument("--warm-up", type=int, default=2,
                        help="untimed rounds first, per mechanism (default 2)")
    parser.add_argument("--relay-ranks", type=int, default=4,
                        help="ranks of the relay's session (default 4)")
    parser.add_argument("--only", type=lambda s: s.split(","), default=None,
                        help="comma-separated mechanisms: " +
                             ",".join(m.name for m in MECHANISMS))
    add_options(parser)
    opts = parser.parse_args()
    unknown = set(opts.only or ()) - {m.name for m in MECHANISMS}
    if unknown:
        parser.error(f"unknown mechanisms: {sorted(unknown)}")
    record = Record.start("fast_paths", opts)
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-") as tmp:
        results = run_all(opts, Path(tmp))
    print(f"\nfast paths, ON against OFF, medians of {opts.rounds} cells each, "
          f"{NPROCS} CPU ranks (gloo; the relay's session {opts.relay_ranks}), cells {opts.gap} s "
          f"apart{record.label}:")
    for name, r in results.items():
        print_one(name, r, record.label)
    record.write({"nprocs": NPROCS, "target_saved_pct": TARGET, "mechanisms": results})
    if any("failed" in r for r in results.values()):
        raise SystemExit("some mechanisms could not be measured: see FAILED above")


if __name__ == "__main__":
    main()
