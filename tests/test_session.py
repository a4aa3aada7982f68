"""Sessions: ranks that keep their state from cell to cell, through a real kernel.

Every line of the sessions issue has a test here: ``%ddp_session`` and ``nbddp.Session``,
which names live on the ranks and which come from the notebook, per-cell options, the
panel and history, and each way a cell can fail (the session keeps its state when every
rank is back at rest, and says so; it restarts and says so when not).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import descendants, run_dirs, wait_until
from .kernel_driver import Kernel
from .test_kernel import _alive, _snapshot

pytestmark = [pytest.mark.slow, pytest.mark.waits]  # kernels and rank groups, several seconds each

START = """
%load_ext nbddp
import os, nbddp
%ddp_session start --nprocs 2
"""

PIDS = """%%ddp
import os
import torch.distributed as dist
(dist.get_rank(), os.getpid())
"""


def session_pids(kernel: Kernel) -> dict[int, int]:
    """The session's rank PIDs, as ``%ddp_session`` reports them."""
    run = kernel.run("_status = %ddp_session\n_status.pids").assert_ok()
    return eval(run.result())  # noqa: S307 - our own repr


def start_session(kernel: Kernel) -> dict[int, str]:
    kernel.run(START, timeout=120).assert_ok()
    return _snapshot(session_pids(kernel).values())


@contextlib.contextmanager
def kernel_with_session(path: Path) -> Iterator[Kernel]:
    """A kernel in ``path`` with a session of 2 ranks open; shut down after."""
    kernel = Kernel(path)
    try:
        start_session(kernel)
        yield kernel
    finally:
        kernel.shutdown()


@pytest.fixture(scope="module")
def skernel(tmp_path_factory):
    """One kernel with an open session, for the tests that keep it whole."""
    with kernel_with_session(tmp_path_factory.mktemp("session")) as kernel:
        yield kernel


@pytest.fixture
def fresh_session(tmp_path):
    with kernel_with_session(tmp_path) as kernel:
        yield kernel


def cell(kernel: Kernel, body: str, options: str = "", timeout: float = 60):
    return kernel.run(f"%%ddp {options}\n{body}", timeout=timeout)


# --- names and cells ----------------------------------------------------------------


def test_cells_run_on_the_same_ranks_and_keep_their_names(skernel):
    first = cell(skernel, "import os\nsteps = 0\nos.getpid()").assert_ok()
    for expected in (1, 2):
        run = cell(skernel, "steps += 1\n(steps, os.getpid())").assert_ok()
        assert eval(run.result()) == (expected, int(first.result()))  # noqa: S307
    assert skernel.run("'steps' in dir()").result() == "False"  # it lives on the ranks


def test_a_run_asked_for_from_another_thread_returns_its_value(skernel):
    """``Session.run`` from a thread of the user's (no Ctrl-C reaches it: a follower
    thread follows its run, not the caller) returns as from the cell itself."""
    run = skernel.run("""
import threading
_session = get_ipython().magics_manager.registry['DDPMagics'].session
_got = []
_asker = threading.Thread(target=lambda: _got.append(_session.run(lambda: 6 * 7)))
_asker.start()
_asker.join(60)
_got
""").assert_ok()
    assert run.result() == "[42]"


def test_a_session_cells_assignment_wins_over_the_notebooks_name(skernel):
    skernel.run("learning_rate = 0.1\nshared = 'from the notebook'").assert_ok()
    cell(skernel, "shared = 'from the ranks'").assert_ok()
    run = cell(skernel, "(learning_rate, shared)").assert_ok()
    assert run.result() == "(0.1, 'from the ranks')"
    skernel.run("learning_rate = 0.5\nshared = 'changed in the notebook'").assert_ok()
    run = cell(skernel, "(learning_rate, shared)").assert_ok()
    assert run.result() == "(0.5, 'from the ranks')"  # the new notebook value, the ranks' own


def test_notebook_functions_see_the_ranks_names(skernel):
    skernel.run("""
        def scaled(x):
            return factor * x          # factor: a name the session assigns

        class Counter:
            def bump(self):
                return factor + 1
    """).assert_ok()
    cell(skernel, "factor = 3").assert_ok()
    assert cell(skernel, "(scaled(2), Counter().bump())").assert_ok().result() == "(6, 4)"


def test_a_notebook_function_called_again_runs_as_the_notebook_has_it_now(skernel):
    """Each call sends the function as the notebook has it: its globals, defaults,
    closures and a redefinition arrive, on all ranks or some."""
    run = skernel.run("""
_session = get_ipython().magics_manager.registry['DDPMagics'].session
offset = 1
def shifted(x, by=0):
    return x + offset + by
def scaler(k):
    return lambda x: x * k
_seen = [_session.run(shifted, 1), _session.run(shifted, 1)]
offset = 10
_seen.append(_session.run(shifted, 1))
shifted.__defaults__ = (100,)
_seen.append(_session.run(shifted, 1))
_seen += [_session.run(scaler(k), 2) for k in (2, 3)]
def shifted(x, by=0):
    return x - offset
_seen.append(_session.run(shifted, 1, ranks=[0]))  # rank 1 is not taught this one
_seen.append(_session.run_all(shifted, 2))
_seen
""").assert_ok()
    assert run.result() == "[2, 2, 11, 111, 4, 6, -9, [-8, -8]]"


def test_notebook_environment_and_directory_reach_the_ranks(skernel, tmp_path):
    skernel.run(f"""
        import warnings
        os.environ["NBDDP_SESSION_SETTING"] = "set between cells"
        os.environ["OMP_NUM_THREADS"] = "3"      # read when a rank starts: a warning
        os.chdir({str(tmp_path)!r})
    """).assert_ok()
    run = cell(skernel, "(os.environ.get('NBDDP_SESSION_SETTING'), os.getcwd(), "
                        "os.environ.get('OMP_NUM_THREADS'))").assert_ok()
    assert eval(run.result()) == ("set between cells", str(tmp_path), "1")  # noqa: S307
    assert "OMP_NUM_THREADS changed in the notebook" in run.stream_text("stderr")
    skernel.run("del os.environ['OMP_NUM_THREADS']").assert_ok()


def test_models_and_the_process_group_persist(skernel):
    cell(skernel, """
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
net = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.01)
""").assert_ok()
    train = """
x = torch.ones(8, 4) * (dist.get_rank() + 1)
loss = net(x).pow(2).mean()
opt.zero_grad(); loss.backward(); opt.step()
float(loss)
"""
    losses = [float(cell(skernel, train).assert_ok().result()) for _ in range(3)]
    assert losses[0] > losses[1] > losses[2], losses  # the same model, trained on


def test_per_cell_options_output_out_all_ranks_and_trailing_expression(skernel):
    run = cell(skernel, "import torch.distributed as dist\n"
                        "print('hello from rank', dist.get_rank(), flush=True)\n"
                        "mine = dist.get_rank() * 10\nmine + 1", "--out mine --all-ranks")
    run.assert_ok()
    assert run.result() == "1"
    assert skernel.run("mine").result() == "0"
    text = run.stream_text()
    assert "[rank 0] hello from rank 0" in text and "[rank 1] hello from rank 1" in text
    quiet = cell(skernel, "print('rank 0 only', flush=True)\nNone").assert_ok()
    assert "rank 0 only" in quiet.stream_text() and "[rank" not in quiet.stream_text()


def test_a_quick_cell_shows_what_the_ranks_printed_and_nothing_more(skernel):
    """A session's quick cell reads like a cell run in the notebook: the ranks' output,
    and no line of nbddp's. A cell that logs metrics (or shows progress, or fails)
    says how it ended. (However long a loaded machine takes: the panel's quarter second
    is stretched here.)"""
    skernel.run("import nbddp._panel.state as _panel_state\n"
                "_panel_state.SHOW_AFTER, _show_after = 60.0, _panel_state.SHOW_AFTER").assert_ok()
    try:
        _quick_cells_quiet(skernel)
    finally:
        skernel.run("_panel_state.SHOW_AFTER = _show_after").assert_ok()


def _quick_cells_quiet(skernel) -> None:
    assert cell(skernel, "None").assert_ok().shown_text() == ""
    said = cell(skernel, "print('from the ranks', flush=True)").assert_ok()
    assert said.shown_text() == "from the ranks\n", said.describe()
    logged = cell(skernel, "import nbddp\nnbddp.log(step=0, loss=1.0)").assert_ok()
    assert "nbddp: finished on 2 ranks (session · run" in logged.stream_text(), \
        logged.describe()
    assert "rank-averaged loss=1" in logged.stream_text()


def test_each_cell_has_its_panel_history_and_last_job(skernel):
    run = cell(skernel, """
import nbddp
import torch.distributed as dist
for step in nbddp.progress(range(5)):
    nbddp.log(step=step, loss=float(step + dist.get_rank()))
""").assert_ok()
    assert any(o.msg_type in ("display_data", "update_display_data") for o in run.outputs)
    history = eval(skernel.run("nbddp.last_job().history").result())  # noqa: S307
    assert [row["loss"] for row in history] == [0.5, 1.5, 2.5, 3.5, 4.5]
    timed = skernel.run("[sorted(info['step_split'] or {}) for info in "
                        "nbddp.last_job().ranks.values()]").result()
    assert eval(timed) == [["collectives", "compute", "data", "seconds"]] * 2  # noqa: S307
    cell(skernel, "None").assert_ok()
    assert skernel.run("nbddp.last_job().history").result() == "[]"  # the last cell's


def test_status_names_ranks_pids_memory_and_uptime(skernel):
    text = skernel.run("%ddp_session").assert_ok().result()
    assert text.startswith("nbddp session: 2 ranks (gloo), up 0:"), text
    pids = session_pids(skernel)
    for rank, pid in pids.items():
        assert f"rank {rank}: pid {pid} on " in text and " MiB resident" in text, text
    assert "runs, 0 restarts; auto mode off, autoreload off" in text.splitlines()[0]


def test_options_that_change_the_shape_are_refused_naming_the_session(skernel):
    for options in ("--nprocs 3", "--backend nccl", "--no-init", "--slurm"):
        err = cell(skernel, "1", options).assert_ok().stream_text("stderr")  # IPython prints
        assert f"UsageError: {options.split()[0]} would need other ranks than the open " \
               "session's (2 ranks)" in err, err
    assert cell(skernel, "1", "--nprocs 2").assert_ok().result() == "1"


def test_starting_a_second_session_is_refused(skernel):
    err = skernel.run("%ddp_session start --nprocs 2").assert_ok().stream_text("stderr")
    assert "UsageError: a session is already open" in err, err


# --- failures -----------------------------------------------------------------------


def test_a_rank_that_raises_at_rest_keeps_the_state(skernel):
    cell(skernel, "kept = 'still here'").assert_ok()
    run = cell(skernel, """
import torch.distributed as dist
if dist.get_rank() == 1:
    raise ValueError("rank one is unhappy")
""")
    assert run.error()["ename"] == "WorkerError", run.describe()
    text = run.error_text()
    assert "rank 1 raised ValueError: rank one is unhappy" in text, text
    assert 'raise ValueError("rank one is unhappy")' in text, text  # the cell's line
    assert "the session's ranks are back at rest, with their state" in text, text
    assert cell(skernel, "kept").assert_ok().result() == "'still here'"


def test_a_rank_that_raises_while_its_peer_waits_restarts_the_session(fresh_session):
    before = _snapshot(session_pids(fresh_session).values())
    cell(fresh_session, "lost = 'soon gone'").assert_ok()
    started = time.monotonic()
    run = cell(fresh_session, """
import time, torch, torch.distributed as dist
if dist.get_rank() == 1:
    time.sleep(3)  # rank 0 is in the all_reduce before rank 1 fails (and is interrupted)
    raise ValueError("rank one fails")
dist.all_reduce(torch.ones(1))   # rank 0 waits here for good
""")
    assert run.error()["ename"] == "WorkerError", run.describe()
    assert run.idle_at - started < 30  # freed in about 10 s, not gloo's 30 minutes
    text = run.error_text()
    assert "rank 1 raised ValueError: rank one fails" in text, text
    assert "the session was restarted: variables defined in earlier cells are gone" in text
    assert not _alive(before)
    assert cell(fresh_session, "'lost' in dir()").assert_ok().result() == "False"
    assert cell(fresh_session, "import torch.distributed as dist\ndist.get_world_size()"
                ).assert_ok().result() == "2"


def test_an_interrupt_reaches_the_ranks_code_and_keeps_the_state(fresh_session):
    cell(fresh_session, "kept = 41").assert_ok()
    run = fresh_session.submit("""%%ddp
import time
try:
    print("working", flush=True)
    while True:
        time.sleep(0.01)
except KeyboardInterrupt:
    kept += 1          # the ranks' code saw the interrupt
    raise
""")
    run.wait_for_output("working")
    fresh_session.km.interrupt_kernel()
    run.finish(timeout=30)
    assert run.error()["ename"] == "KeyboardInterrupt", run.describe()
    assert "the session's ranks are back at rest, with their state" in run.error_text()
    assert cell(fresh_session, "kept").assert_ok().result() == "42"


def test_an_interrupt_while_the_cell_starts_stops_it_on_the_ranks(fresh_session):
    """Ctrl-C pressed while the cell is being handed to the ranks (here: as its notebook
    value is pickled, the first step) is not lost in nbddp's start-up: the run starts
    and is interrupted on the ranks, as if pressed a moment later, and the session takes
    the next cell (before, a press just after the hand-over left the run going on the
    ranks, followed by no cell, and the next cell waited for it forever)."""
    fresh_session.run("""
import os, signal
class StopPressed:
    def __reduce__(self):  # pickled as the cell is handed over: Ctrl-C, then
        os.kill(os.getpid(), signal.SIGINT)
        return (StopPressed, ())
button = StopPressed()
""").assert_ok()
    run = cell(fresh_session, """import time
button
time.sleep(120)""", timeout=60)
    assert run.error()["ename"] == "KeyboardInterrupt", run.describe()
    assert "the session's ranks are back at rest, with their state" in run.error_text()
    assert cell(fresh_session, "'ready for the next cell'").assert_ok().result() == \
        "'ready for the next cell'"


def test_an_interrupt_in_a_run_s_first_moments_stops_it_and_keeps_the_state(fresh_session):
    """Ctrl-C pressed a few milliseconds into a run, while the cell itself follows it (a
    run the caller waits for is followed by no other thread at first: ``_run.job``),
    stops it on the ranks as a press at any other moment does."""
    cell(fresh_session, "kept = 'the state'").assert_ok()
    run = fresh_session.run("""
import os, signal, threading, time
_session = get_ipython().magics_manager.registry['DDPMagics'].session
threading.Timer(0.03, os.kill, (os.getpid(), signal.SIGINT)).start()
_session.run(time.sleep, 120)
""")
    assert run.error()["ename"] == "KeyboardInterrupt", run.describe()
    assert "the session's ranks are back at rest, with their state" in run.error_text()
    assert cell(fresh_session, "kept").assert_ok().result() == "'the state'"


def test_an_interrupt_while_the_ranks_take_up_the_cell_stops_it_there(fresh_session):
    """Ctrl-C while the ranks still unpack the cell, before its code starts, is kept by
    each rank and raised as that code starts (before, a rank dropped it and ran the
    whole cell: here two minutes, after which the session was restarted, its state
    lost). A rank of a SLURM session whose kernel dies takes this path too."""
    fresh_session.run("""
import time
def unpacked_slowly():
    print("unpacking on the ranks", flush=True)
    time.sleep(3)
    return "unpacked"
class SlowToUnpack:
    def __reduce__(self):
        return (unpacked_slowly, ())
slow = SlowToUnpack()
""").assert_ok()
    cell(fresh_session, "kept = 'the state'").assert_ok()
    run = fresh_session.submit("%%ddp\nslow\nimport time\ntime.sleep(120)")
    run.wait_for_output("unpacking on the ranks")
    fresh_session.km.interrupt_kernel()
    run.finish(timeout=60)
    assert run.error()["ename"] == "KeyboardInterrupt", run.describe()
    assert "the session's ranks are back at rest, with their state" in run.error_text()
    assert "contextlib" not in run.error_text()  # raised before the code: no frames of it
    assert cell(fresh_session, "kept").assert_ok().result() == "'the state'"


def test_a_cell_timeout_interrupts_the_ranks_and_keeps_the_state(skernel):
    cell(skernel, "ticks = 0").assert_ok()
    run = cell(skernel, "import time\nwhile True:\n    ticks += 1\n    time.sleep(0.01)",
               "--timeout 2")
    assert run.error()["ename"] == "TimeoutError", run.describe()
    assert "did not finish within 2" in run.error_text()
    assert "with their state" in run.error_text()
    assert int(cell(skernel, "ticks").assert_ok().result()) > 10


def test_a_rank_that_dies_restarts_the_session_and_says_so(fresh_session):
    cell(fresh_session, "lost = True").assert_ok()
    run = cell(fresh_session, """
import os, time
import torch.distributed as dist
if dist.get_rank() == 1:
    os._exit(3)
time.sleep(30)
""")
    assert run.error()["ename"] == "WorkerError", run.describe()
    text = run.error_text()
    assert "rank 1 exited with code 3" in text, text
    assert "the session was restarted" in text, text
    assert cell(fresh_session, "'lost' in dir()").assert_ok().result() == "False"


def test_a_rank_killed_while_idle_means_fresh_ranks_for_the_next_cell(fresh_session):
    """The out-of-memory killer picks idle processes too: the next cell runs on fresh
    ranks and says the state is gone, whether nbddp has seen the death yet or not. A
    notebook function the old ranks held goes whole to the fresh ones."""
    fresh_session.run("def rank_pid():\n    return os.getpid()").assert_ok()
    for victim, seen in ((1, False), (0, True)):
        cell(fresh_session, "lost = 'soon gone'\nrank_pid()").assert_ok()
        idle = _snapshot(descendants(fresh_session.pid))  # torchrun and the ranks
        fresh_session.run(f"import signal\nos.kill({session_pids(fresh_session)[victim]}, "
                          "signal.SIGKILL)").assert_ok()
        if seen:  # torchrun has stopped the other rank, and the kernel knows
            wait_until(lambda idle=idle: not _alive(idle), timeout=15)
        run = cell(fresh_session, "('lost' in dir(), rank_pid())").assert_ok()
        lost, pid = eval(run.result())  # noqa: S307 - our own repr
        assert not lost and pid not in idle
        # Unseen, the victim's death races torchrun stopping the other rank: the kernel
        # may hear of either first, and says the one it heard of.
        named = rf"rank {victim}" if seen else r"rank [01]"
        assert re.search(rf"nbddp: session: {named} had stopped while idle; the session "
                         "was restarted: variables defined in earlier cells are gone",
                         run.stream_text()), run.describe()
        assert not _alive(idle)
        assert set(session_pids(fresh_session).values()) < descendants(fresh_session.pid)
    status = fresh_session.run("_status = %ddp_session\n_status.restarts").assert_ok()
    assert status.result() == "2"


def test_what_a_replaced_ranks_process_writes_late_stays_with_the_cell_before(fresh_session):
    """Rank 0 started a process of its own in a cell (a data loader's worker, a tool),
    which writes to the rank's output after that cell is over. Rank 1 is killed while
    idle, the next cell replaces the ranks, and the late line comes as it runs: it
    belongs to the cell that started the process, not under the next one."""
    cell(fresh_session, """
import subprocess, sys
import torch.distributed as dist
if dist.get_rank() == 0:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5); "
                      "print('late words from the old rank 0', flush=True)"],
                     start_new_session=True)
""").assert_ok()
    fresh_session.run("before = nbddp.last_job()").assert_ok()
    fresh_session.run(f"os.kill({session_pids(fresh_session)[1]}, 9)").assert_ok()
    run = cell(fresh_session, "import time\ntime.sleep(2)\nprint('the next cell', flush=True)"
               ).assert_ok()
    assert "rank 1 had stopped while idle" in run.stream_text(), run.describe()
    assert "the next cell" in run.stream_text(), run.describe()
    assert "late words" not in run.stream_text(), run.describe()
    logs = fresh_session.run("nbddp.last_job().logs[0]").assert_ok().result()
    assert "the next cell" in logs and "late words" not in logs, logs
    assert "late words from the old rank 0" in fresh_session.run(
        "before.logs[0]").assert_ok().result()


SETTLE_AND_MORE = 12  # longer than the 10 s a failed cell's ranks get, and standby's 1 s


def test_an_idle_session_waits_beyond_any_idle_timeout(skernel):
    skernel.run("nbddp.standby(idle_timeout=1)").assert_ok()  # standby's, not ours
    try:
        cell(skernel, "patience = 'intact'").assert_ok()
        time.sleep(SETTLE_AND_MORE)
        assert cell(skernel, "patience").assert_ok().result() == "'intact'"
    finally:
        skernel.run("nbddp.standby(idle_timeout=600)").assert_ok()


# --- the end --------------------------------------------------------------------------


def test_stop_and_restart(fresh_session):
    first = _snapshot(session_pids(fresh_session).values())
    cell(fresh_session, "forgotten = 1").assert_ok()
    fresh_session.run("%ddp_session restart").assert_ok()
    assert not _alive(first)
    assert cell(fresh_session, "'forgotten' in dir()").assert_ok().result() == "False"
    second = _snapshot(session_pids(fresh_session).values())
    text = fresh_session.run("%ddp_session stop").assert_ok().stream_text()
    assert "stopped" in text
    assert not _alive(second) and not descendants(fresh_session.pid)
    again = fresh_session.run("%%ddp --nprocs 3\nimport torch.distributed as dist\n"
                              "dist.get_world_size()").assert_ok()
    assert again.result() == "3"  # a one-off run again


def test_an_interrupt_while_the_session_stops_still_stops_every_rank(fresh_session, tmp_path):
    """Ctrl-C during %ddp_session stop (impatient, or stop pressed twice) is raised once
    the ranks are gone: not in the middle, where ranks sent SIGTERM were never sent
    SIGKILL and a session marked closed kept them running."""
    marker = tmp_path / "sigterm"
    cell(fresh_session, f"""import signal
import torch.distributed as dist
def note_sigterm(signum, frame):  # the ranks outlast SIGTERM: stopping them takes SIGKILL
    open({str(marker)!r} + str(dist.get_rank()), "w").close()
signal.signal(signal.SIGTERM, note_sigterm)""").assert_ok()
    ranks = _snapshot(session_pids(fresh_session).values())
    stop = fresh_session.submit("%ddp_session stop")
    wait_until(lambda: list(tmp_path.glob("sigterm*")), timeout=30, interval=0.01)
    fresh_session.km.interrupt_kernel()  # while the stop waits for the ranks to go
    stop.finish(timeout=30)
    assert stop.error()["ename"] == "KeyboardInterrupt", stop.describe()
    assert not _alive(ranks) and not descendants(fresh_session.pid)
    assert fresh_session.run("%ddp_session").assert_ok().stream_text().startswith(
        "no session"), "the session is stopped"


def test_an_interrupt_while_the_session_starts_leaves_nothing_running(tmp_path):
    """Ctrl-C while %ddp_session start waits for its ranks (cold: standby is off here)
    stops them, and no session is open."""
    kernel = Kernel(tmp_path, env={**os.environ, "NBDDP_STANDBY": "0"})
    try:
        start = kernel.submit(START)
        wait_until(lambda: descendants(kernel.pid), timeout=30, interval=0.01)
        kernel.km.interrupt_kernel()  # torchrun is up; the ranks are still importing
        start.finish(timeout=60)
        assert start.error()["ename"] == "KeyboardInterrupt", start.describe()
        wait_until(lambda: not descendants(kernel.pid), timeout=15)
        assert kernel.run("%ddp_session").assert_ok().stream_text().startswith(
            "no session")
    finally:
        kernel.shutdown()


@pytest.mark.parametrize("how", ["killed", "shut down"])
def test_a_kernel_that_goes_leaves_nothing_of_its_session(tmp_path, how):
    kernel = Kernel(tmp_path)
    before = run_dirs()
    try:
        ranks = start_session(kernel)
        cell(kernel, "x = 1").assert_ok()
        procs = {**ranks, **_snapshot(descendants(kernel.pid))}
        kernel.end(how)
        wait_until(lambda: not _alive(procs), timeout=15)
        wait_until(lambda: not (run_dirs() - before), timeout=15)
    finally:
        kernel.shutdown()


def test_a_kernel_killed_as_it_stops_its_ranks_at_exit_leaves_nothing_on_disk(tmp_path):
    """A front end shutting a kernel down kills it if it takes too long to exit; killed
    the moment its ranks' torchrun is gone (torchrun, which removes the run's folders
    when the kernel dies, is then no longer there to do it), it leaves no folder behind,
    in the temp dir or in shared memory."""
    kernel = Kernel(tmp_path)
    before = run_dirs()
    try:
        start_session(kernel)
        cell(kernel, "import torch\nx = torch.ones(1)").assert_ok()
        procs = _snapshot(descendants(kernel.pid))
        torchrun = [pid for pid in procs if "nbddp._torchrun" in
                    Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
        assert torchrun, procs
        assert run_dirs() - before  # (the session's run dir and its twin)
        kernel.kc.shutdown()  # the request a front end sends; the kernel exits
        while any(os.path.exists(f"/proc/{pid}") for pid in torchrun):  # (reaped by
            time.sleep(0.0002)  # the kernel: the moment its stop returns)
        os.kill(kernel.pid, signal.SIGKILL)  # ... and is killed as torchrun is gone
        wait_until(lambda: not _alive(procs), timeout=15)
        wait_until(lambda: not (run_dirs() - before), timeout=15)
    finally:
        kernel.shutdown()


# --- in Python ----------------------------------------------------------------------


def test_the_python_session_api(kernel):
    run = kernel.run("""
        def setup(n):
            global weights
            import torch
            weights = torch.arange(float(n))
            return "ready"

        def total(extra=0):
            import torch.distributed as dist
            t = weights.sum() + extra
            dist.all_reduce(t)
            return t.item()

        with nbddp.Session(nprocs=2) as session:
            ready = session.run(setup, 4)
            each = session.run_all(total, extra=1)
            session.restart()
            try:
                session.run(total)
            except nbddp.WorkerError as error:
                after_restart = type(error.__cause__).__name__
        (ready, each, after_restart, session.closed)
    """, timeout=120).assert_ok()
    assert run.result() == "('ready', [14.0, 14.0], 'NameError', True)"


def test_output_none_prints_nothing_run_after_run(kernel):
    """A script or a benchmark looping over ``Session.run`` with ``output="none"`` gets no
    line per run: no rank output, no panel, no finish line; the records keep the output."""
    run = kernel.run("""
        def says(i):
            print(f"rank output {i}")
            return i

        with nbddp.Session(nprocs=2, output="none") as quiet:
            values = [quiet.run(says, i) for i in range(3)]
            logs = nbddp.last_job().logs[0]
        (values, "rank output 2" in logs)
    """, timeout=120).assert_ok()
    assert run.result() == "([0, 1, 2], True)"
    assert run.shown_text() == "", run.shown_text()
