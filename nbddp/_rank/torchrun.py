"""torchrun itself, run in-process so the kernel learns exactly how each rank ended.

``python -m nbddp._torchrun RUN_DIR LIFELINE_FD TORCHRUN_ARGS...`` parses and runs
torchrun's own command line (``torch.distributed.run``). Additions only:

- when ranks fail, torchrun's structured failures (rank, exit code, signal) are written
  to ``failures-<host>-<pid>.json`` (one per machine) instead of being left as text for
  the kernel to parse;
- torchrun's own logs go inside the run dir (``--log-dir``), not into a temp dir;
- the kernel (or a Ray node's agent) holds the write end of a pipe (the lifeline); if
  it dies the pipe closes and this process stops torchrun, so no rank outlives the
  notebook. It starts this process before it makes the run dir (an agent: and the
  node's data folders), then says so on the lifeline (``LIFELINE_GO``): until then
  torchrun waits, and if its starter dies first, this process removes what it had made,
  which nothing else would (its output goes to the starter until then, and to the run
  dir's log after). A SLURM job has no lifeline (``-``): it outlives a kernel restart,
  and can be re-attached;
- with ``--relay`` (first), it starts the node's relay (``_rank.relay``) before its ranks,
  which then talk to the kernel through it; with ``--relay-tree`` too (a session of many
  nodes), the relay asks the kernel for its place in a tree of relays
  (``_wire.relay_tree``);
- with ``--report FD`` (after ``--node-data``; a Ray agent's), it goes on in a child of
  its own and says its exit code on that pipe (see ``_leave_the_parent``);
- with ``--node-data`` (after the lifeline; a cluster session's), it makes this node's
  private folders for the data files the kernel sends (in shared memory, and on local
  disk for those that do not fit there), or takes those a Ray agent made and named in
  its environment, names them to the ranks, and removes them when torchrun ends,
  however its ranks ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from .._wire.channel import ChannelClient
from .._wire.dataplane import shm_root
from .._wire.rundir import (
    LIFELINE_GO,
    NODE_DISK_ENV,
    NODE_FOLDER,
    NODE_SHM_ENV,
    RELAY_ENV,
    RELAY_SOCKET,
    RunDir,
    parse_address,
)
from .._wire.transfer import Inbox
from .attachable import next_kernel
from .link import node_inbox
from .relay import Landing, NodeRelay, Reattach
from .relay_placement import node_relay

_GRACE_SECONDS = 5.0
_AGENT_CLEAN_UP_WAIT = 60.0  # after the report: how long the agent may take to clean up
_RELAY_FLUSH_WAIT = 5.0  # torchrun ended: how long its relay may take to send what is left


def _watch_lifeline(fd: int, run_dir: RunDir, folders: list[Path], lost: threading.Event,
                    ended: threading.Event) -> None:
    """Block until the kernel's end of the pipe closes, then stop everything (once
    torchrun has ``ended``: only the run dir is left to remove)."""
    while os.read(fd, 4096):
        pass
    run_dir.remove()  # first: torchrun's own clean-up may be past its look at the lifeline
    lost.set()
    if ended.is_set():
        return
    print("nbddp: the notebook kernel went away; stopping torchrun", file=sys.stderr)
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun's own shutdown: it stops its ranks
    time.sleep(_GRACE_SECONDS)
    run_dir.remove()
    _remove(folders)  # (torchrun's own clean-up did not come)
    os.kill(os.getpid(), signal.SIGKILL)  # ranks die with us (PR_SET_PDEATHSIG)


def _remove(folders: list[Path]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _write_failures(run_dir: RunDir, error) -> None:
    """How each failed rank ended, for the kernel's diagnosis (if it still listens: a
    kernel done with the run may have removed the run dir already)."""
    failures = {
        rank: {"exitcode": f.exitcode, "pid": f.pid, "timestamp": f.timestamp,
               "signal": f.signal_name() if f.exitcode < 0 else None}
        for rank, f in error.failures.items()
    }
    path = run_dir.failures_file()
    tmp = path.with_suffix(".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.write_text(json.dumps(failures))
        tmp.replace(path)


def _node_folders() -> list[Path]:
    """This node's private (0700) folders for data files, named to the ranks: one in
    shared memory where there is one, one on local disk (``$TMPDIR``). Where the node's
    agent made them (a Ray session's), they are those (and this process removes them
    too, should the agent have died first)."""
    made = [os.environ.get(NODE_SHM_ENV), os.environ.get(NODE_DISK_ENV)]
    if made[1]:
        return [Path(folder) for folder in made if folder]
    folders = []
    shm = shm_root()
    if shm is not None:
        folders.append(_private_folder(shm))
        os.environ[NODE_SHM_ENV] = str(folders[-1])
    folders.append(_private_folder(Path(tempfile.gettempdir())))
    os.environ[NODE_DISK_ENV] = str(folders[-1])
    return folders


def _private_folder(parent: Path) -> Path:
    """A new folder of this user's alone in ``parent``, under the name the session's task
    epilog removes (``NODE_FOLDER``); should someone have taken that name first (anyone
    may write to ``/dev/shm``), one whose name nobody can guess instead."""
    name = NODE_FOLDER.format(uid=os.getuid(), job=os.environ.get("SLURM_JOB_ID", "-"),
                              step=os.environ.get("SLURM_STEP_ID", "-"),
                              node=os.environ.get("SLURMD_NODENAME", "-"))
    try:
        os.mkdir(parent / name, 0o700)
    except FileExistsError:
        print(f"nbddp: {parent / name} exists already; using another name", file=sys.stderr)
        return Path(tempfile.mkdtemp(prefix="nbddp-node-", dir=parent))
    return parent / name


def _wait_for_run_dir(fd: int, run_dir: RunDir, folders: list[Path]) -> bool:
    """Wait for the kernel's (or a Ray agent's) word that it made the run dir; True if
    it did. One that died before (the pipe closed) may have made part of it, and of the
    node's data folders it named: that goes."""
    word = os.read(fd, 1)
    if word == LIFELINE_GO:
        _output_to(run_dir.append_to_launcher_log())
        return True
    if not word:
        run_dir.remove()
        _remove(folders)  # (a Ray agent's, which makes the folders it names meanwhile)
    return False  # (LIFELINE_ABANDON: the name was someone else's)


def _output_to(fd: int) -> None:
    """This process's output (and its ranks', who inherit it) into ``fd``."""
    for stream in (1, 2):
        os.dup2(fd, stream)
    os.close(fd)


def _signals_as_usual() -> None:
    """Take signals as a process started from a shell does: whoever started this one may
    have blocked or ignored some (a Ray worker's threads block them, and a child keeps
    its parent's mask), and torchrun's stop (SIGTERM) and a rank's interrupt (SIGINT,
    passed on to every rank torchrun starts) must arrive. SIGTERM ends this process
    through its clean-up from the start (``_stopped``), not only once torch handles it:
    killed while it still imports torch, it would leave the node's folders."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _stopped)


def _stopped(signum: int, frame: FrameType | None) -> None:
    """SIGTERM before torch handles it: leave through the clean-up, as torch's own
    handler does (``SignalException``), with the exit code of a process it killed."""
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    _signals_as_usual()
    options = _own_options(argv[2:])
    path = Path(argv[0])  # (a node's run dir has no twin in shared memory: its data
    run_dir = RunDir(path) if options.node_data else RunDir.named(path)  # folders)
    if options.report is not None:
        _leave_the_parent()
    lost, ended = threading.Event(), threading.Event()
    code = -1
    try:
        code = _run(run_dir, argv[1], options, lost, ended)
    except SystemExit as stopped:  # (SIGTERM before torch's own handler: see _stopped)
        code = stopped.code if isinstance(stopped.code, int) else 1
        raise
    finally:
        ended.set()
        if options.report is not None:
            _report(options.report, code, lost if argv[1] != "-" else None)
    return code


def _report(fd: int, code: int, lost: threading.Event | None) -> None:
    """Say ``code`` to the agent, then stay until it lets go of the lifeline, which it
    does once it has read torchrun's log and removed the run dir. An agent killed first
    (its kernel's job ended just as the ranks left: they saw the kernel go) closes the
    lifeline too, and the watcher removes the run dir then: nobody else would."""
    with contextlib.suppress(OSError):
        os.write(fd, str(code).encode())
        os.close(fd)
    if lost is not None:
        lost.wait(_AGENT_CLEAN_UP_WAIT)


@dataclasses.dataclass(frozen=True)
class _Options:
    """nbddp's options before torchrun's (in this order): ``--relay``, ``--relay-tree``,
    ``--node-data``, ``--report FD``."""

    relay: bool
    relay_tree: bool
    node_data: bool
    report: int | None
    torchrun: list[str]


def _own_options(argv: list[str]) -> _Options:
    """nbddp's own options, in any order, before torchrun's."""
    flags: set[str] = set()
    report = None
    while argv[:1] in (["--relay"], ["--relay-tree"], ["--node-data"], ["--report"]):
        if argv[0] == "--report":
            report, argv = int(argv[1]), argv[2:]
        else:
            flags.add(argv[0])
            argv = argv[1:]
    return _Options("--relay" in flags, "--relay-tree" in flags, "--node-data" in flags,
                    report, argv)


def _leave_the_parent() -> None:
    """Go on in a child of this process, which ends at once: whoever started torchrun
    then has no child to kill when it dies (Ray kills an actor's children with
    SIGKILL), and torchrun, told by its lifeline, stops its ranks and removes its files
    itself. It says how it ended on ``--report``'s pipe."""
    if os.fork() != 0:
        os._exit(0)


def _run(run_dir: RunDir, lifeline_arg: str, options: _Options,
         lost: threading.Event, ended: threading.Event) -> int:
    lifeline = None if lifeline_arg == "-" else int(lifeline_arg)
    folders = _node_folders() if options.node_data else []  # (a Ray agent's: named)
    if lifeline is not None and not _wait_for_run_dir(lifeline, run_dir, folders):
        lost.set()  # (the starter died first, or the names were someone else's)
        return 0
    try:  # (the watcher may stop this thread as it starts: from here, the files go)
        if lifeline is not None:
            threading.Thread(target=_watch_lifeline,
                             args=(lifeline, run_dir, folders, lost, ended),
                             daemon=True).start()
        return _torchrun(run_dir, options)
    finally:  # (also when stopped while starting: this thread made the last of the files)
        _clean_up(run_dir, lifeline, folders)


def _clean_up(run_dir: RunDir, lifeline: int | None, folders: list[Path]) -> None:
    """torchrun is over (its ranks stopped): the node's folders go, and the run dir if
    its kernel or agent has gone (nobody else is left to remove it). A second stop is
    ignored from here, and one that lands as this begins still leaves the files gone."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    finally:
        if lifeline is not None and _closed(lifeline):
            run_dir.remove()
        _remove(folders)


def _torchrun(run_dir: RunDir, options: _Options) -> int:
    """torchrun itself, and the node's relay beside it; 1 if a rank failed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    relay = _start_relay(run_dir, remote=options.node_data, tree=options.relay_tree) \
        if options.relay else None
    try:
        run(parse_args(["--log-dir", str(run_dir.torchrun_log_dir()), *options.torchrun]))
    except ChildFailedError as error:
        _write_failures(run_dir, error)
        return 1
    finally:
        if relay is not None:  # (its ranks are gone: what they said last goes first)
            relay.close(wait=_RELAY_FLUSH_WAIT)
    return 0


def _closed(lifeline: int) -> bool:
    """The kernel has let go of the lifeline (it died): its end reads at once (whether
    or not the watcher has seen it yet). Asked as torchrun ends, whose ranks a dying
    kernel ends too (they lose its channel): the lifeline's watcher, a daemon thread,
    may then be removing the run dir, and would die with this process mid-way (a run
    dir half removed was seen)."""
    return bool(select.select([lifeline], [], [], 0)[0])


def _start_relay(run_dir: RunDir, remote: bool, tree: bool = False) -> NodeRelay | None:
    """This node's relay, its socket named to the ranks; None (they connect to the
    kernel themselves) if the kernel cannot be reached from here. ``remote``: a cluster
    session's node, whose kernel listens on TCP (the address file) and whose data files
    cross the relay (into the node's folders); ``tree``: its relay takes its place in
    the kernel's tree of relays."""
    listen = _relay_socket() if remote else run_dir.relay_socket
    try:
        key = run_dir.key.read_bytes()
        if remote:
            address, inbox = run_dir.address.read_text(), node_inbox(run_dir)
            relay = node_relay(parse_address(address), listen, key, inbox=inbox,
                               landing=_landing(),
                               reattach=_next_kernel(run_dir, address, key, inbox),
                               tree=tree)
        else:
            relay = node_relay(run_dir.socket, listen, key)
    except (OSError, ValueError, ConnectionError) as exc:
        print(f"nbddp: no relay on this node ({exc}); its ranks reach the kernel "
              "themselves", file=sys.stderr)
        return None
    os.environ[RELAY_ENV] = str(listen)
    return relay


def _next_kernel(run_dir: RunDir, address: str, key: bytes, inbox: Inbox) -> Reattach:
    """How a cluster node's relay reaches the next kernel that attaches to the session
    (the first is at ``address``): it waits as long as its ranks do (they end when the
    grace period passes, and this torchrun, which closes the relay, with them)."""
    served = [address]

    def reattach(closed: Callable[[], bool]) -> ChannelClient | None:
        found = next_kernel(run_dir, served[0], None, lambda new: ChannelClient(
            parse_address(new), key, inbox), stopped=closed)
        if found is None:
            return None
        channel, served[0] = found
        return channel

    return reattach


def _relay_socket() -> Path:
    """A cluster node's relay listens in the node's private folder on local disk (the
    session's folder is shared by every node: a socket there would be one for all)."""
    return Path(os.environ[NODE_DISK_ENV]) / RELAY_SOCKET


def _landing() -> Landing:
    """Where the ranks' result files land on their way to the kernel: in the node's
    private folders (removed with them when torchrun ends)."""
    shm = os.environ.get(NODE_SHM_ENV)
    return Landing(Path(shm) / "relayed" if shm else None,
                   Path(os.environ[NODE_DISK_ENV]) / "relayed")
