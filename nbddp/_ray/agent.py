"""A Ray session's agent: one small actor per node, which starts the node's torchrun and
owns its end.

Ray places the agent in its node's bundle of the session's placement group, and kills
only an actor's own process and its direct children: torchrun, which goes on in a child
of its starter, in a process session of its own, would outlive it. So the agent holds
torchrun's lifeline (``nbddp._torchrun``): whenever the agent ends (stopped, killed with
``ray.kill``, its node's raylet gone, the kernel's job over), the pipe closes and
torchrun stops its ranks and removes the node's run dir and data folders. The agent
starts torchrun before it makes them, under their names, so that from the first one
made there is someone to remove them. ``stop`` ends it first, in order.

The node's run dir is the agent's (private, on the node's own disk): the run's key and
the kernel's address, which the ranks read, and torchrun's log. The key comes with
``start`` (a direct call to the actor, never put in Ray's object store or named) and is
written 0600 in the 0700 folder. A kernel that attaches tells the agent its new address
(``attach``), and the ranks, which wait for one, connect to it.

This module runs on the nodes, in Ray's worker process: it imports ray there, never in
the kernel (``NodeAgent`` is made a Ray actor class where it is used).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .._wire.dataplane import shm_root
from .._wire.rundir import (
    LIFELINE_ABANDON,
    LIFELINE_GO,
    NODE_DISK_ENV,
    NODE_NAME_ENV,
    NODE_SHM_ENV,
    RunDir,
    reserved_name,
)
from .object_store import write_on_node

_TERM_WAIT = 5.0  # torchrun stops its ranks on SIGTERM; SIGKILL after this


class NodeAgent:
    """The agent of one node (see the module's docstring)."""

    def __init__(self, index: int, outlives_kernel: bool) -> None:
        self.index = index
        self.outlives_kernel = outlives_kernel
        self.run_dir: RunDir | None = None
        self.torchrun_group: int | None = None
        """The process group torchrun runs in (its starter's PID)."""
        self.code = -1
        """torchrun's exit code, once it has ended (-9: killed, it said none)."""
        self._lifeline = self._report = -1
        self._early: threading.Thread | None = None  # torchrun's output before its log
        self._folders: list[Path] = []
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._stopping = False
        self._last_words = ""  # the end of torchrun's log, kept as its folder goes
        self._node = _this_node()

    def where(self) -> dict[str, Any]:
        """This node as Ray and the ranks know it: its id, address, host name, the name
        its ranks give it, and the GPUs Ray assigned to the bundle."""
        return self._node

    def free_port(self) -> int:
        """A port free on this node now, for the c10d rendezvous (the first node's)."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            return probe.getsockname()[1]

    def start(self, key: bytes, address: bytes, torchrun_args: list[str],
              worker_args: list[str], env: dict[str, str], cwd: str | None) -> str:
        """Start torchrun on ``torchrun_args`` and nbddp's worker, then make the node's
        run dir (key, kernel's address) and data folders; the run dir's path.

        torchrun starts first, under the names of what is then made, and waits for the
        word: an agent killed from then on (Ray kills an actor's children with it, not
        their children) leaves a torchrun that removes whatever was made."""
        with self._lock:
            if self.torchrun_group is not None:
                raise RuntimeError("this node's torchrun was started already")
            if self._stopping:  # (an actor's calls run in threads, in no set order)
                raise RuntimeError("this node's agent was stopped before torchrun started")
            run_dir = RunDir(reserved_name("nbddp-ray-", Path(tempfile.gettempdir())))
            folders = _reserved_node_folders()
            starter = self._start_torchrun(run_dir, folders, torchrun_args, worker_args,
                                           env, cwd)
            assert starter.stdout is not None  # (a pipe)
            try:
                self._make(run_dir, folders, key, address)
                self._early = run_dir.keep_early_output(starter.stdout)
                self._go(starter)
            except BaseException:
                self._let_go()
                raise
            self.torchrun_group = starter.pid
            threading.Thread(target=self._watch, daemon=True, name="nbddp-torchrun").start()
        return str(run_dir.path)

    def _start_torchrun(self, run_dir: RunDir, folders: list[Path], torchrun_args: list[str],
                        worker_args: list[str], env: dict[str, str], cwd: str | None
                        ) -> subprocess.Popen[bytes]:
        """Start torchrun, which waits on its lifeline for the run dir (its output goes
        to a pipe until it writes to the run dir's log itself); its starter, ended."""
        where = self._node
        ranks_env = {**_node_environment(), **env, NODE_NAME_ENV: where["name"],
                     NODE_SHM_ENV: str(folders[0]), NODE_DISK_ENV: str(folders[-1])}
        if len(folders) == 1:
            ranks_env.pop(NODE_SHM_ENV)
        if where["gpus"]:
            ranks_env["CUDA_VISIBLE_DEVICES"] = ",".join(where["gpus"])
        read_end, self._lifeline = os.pipe()
        self._report, report = os.pipe()
        path = str(run_dir.path)
        command = [sys.executable, "-m", "nbddp._torchrun", path, str(read_end),
                   "--node-data", "--report", str(report), *torchrun_args,
                   "-m", "nbddp._worker", path, *worker_args]
        try:
            starter = subprocess.Popen(
                command, env=ranks_env, cwd=cwd if cwd and os.path.isdir(cwd) else None,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                pass_fds=(read_end, report), start_new_session=True)
        except BaseException:
            self._let_go()
            raise
        finally:
            for fd in (read_end, report):
                os.close(fd)
        if starter.wait() != 0:  # (it goes on in a child: see nbddp._torchrun's --report)
            self._let_go()
            raise RuntimeError(_ended_early(starter))
        return starter

    def _make(self, run_dir: RunDir, folders: list[Path], key: bytes, address: bytes
              ) -> None:
        """Make the run dir and the node's folders, private (0700). A name someone took
        first (they are in ``ps``'s listing of torchrun) stops the start: what this made
        goes, and then torchrun is told to end, removing nothing of theirs."""
        made: list[Path] = []
        try:
            for path in (run_dir.path, *folders):
                os.mkdir(path, 0o700)
                made.append(path)
            run_dir.write_private(run_dir.key, key)
            run_dir.write_private(run_dir.address, address)
        except OSError:
            for path in made:
                shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.write(self._lifeline, LIFELINE_ABANDON)
            raise
        self.run_dir, self._folders = run_dir, folders

    def _go(self, starter: subprocess.Popen[bytes]) -> None:
        """Tell torchrun that its run dir is made; RuntimeError, with what it said, if it
        ended before (it removed what was made, its lifeline closed)."""
        try:
            os.write(self._lifeline, LIFELINE_GO)
        except BrokenPipeError:
            if self._early is not None:
                self._early.join(_TERM_WAIT)
            self._remove_files()  # (under start's lock)
            raise RuntimeError(_ended_early(starter, self._last_words)) from None

    def _let_go(self) -> None:
        """The start failed: close this side of torchrun's pipes (a torchrun still
        waiting for its word ends, removing what it was named)."""
        for fd in (self._lifeline, self._report):
            if fd >= 0:
                os.close(fd)
        self._lifeline = self._report = -1

    def _watch(self) -> None:
        """torchrun ended (its report pipe closed): the node's files go. The ranks of a
        session that outlives its kernel end by themselves once no kernel came within
        the grace period: then the whole placement group goes with them (a session is
        all its nodes or nothing)."""
        said = b""
        while chunk := os.read(self._report, 64):
            said += chunk
        os.close(self._report)
        self.code = int(said) if said.strip().lstrip(b"-").isdigit() else -9
        if self._early is not None:  # (what torchrun said before its log, in it first)
            self._early.join(_TERM_WAIT)
        self._clean_up()
        self._ended.set()
        if self.outlives_kernel and not self._stopping:
            _remove_own_placement_group()

    def keep(self, stored: tuple[bytes, list[Any]]) -> str:
        """A payload the kernel put into Ray's object store (Ray fetched it to this node
        for the call), written into the node's shared memory for its ranks; the file."""
        return write_on_node(stored, self._folders)

    def wait(self) -> tuple[int, str]:
        """Block until the node's torchrun has ended: its exit code and the end of its
        log (why it ended)."""
        self._ended.wait()
        return self.code, self._last_words

    def attach(self, address: bytes) -> None:
        """A new kernel listens at ``address``: the ranks, who wait for one, connect."""
        if self.run_dir is not None:
            self.run_dir.replace_private(self.run_dir.address, address)

    def tail(self, lines: int = 30) -> str:
        """The end of torchrun's log on this node (once its folder went: as it was)."""
        if self.run_dir is not None:
            with contextlib.suppress(OSError):
                text = self.run_dir.launcher_log.read_text(errors="replace")
                return "\n".join(text.splitlines()[-lines:])
        return self._last_words

    def stop(self) -> None:
        """Stop torchrun and its ranks (SIGTERM, then SIGKILL), and remove the node's
        files: nothing of the session is left on this node. A start under way ends first;
        none begins after."""
        self._stopping = True
        with self._lock:
            group = self.torchrun_group
        if group is not None and not self._ended.is_set():
            _signal_group(group, signal.SIGTERM)
            if not self._ended.wait(_TERM_WAIT):
                _signal_group(group, signal.SIGKILL)  # (its ranks die with it)
                self._ended.wait(_TERM_WAIT)
        self._clean_up()

    def _clean_up(self) -> None:
        with self._lock:
            self._remove_files()

    def _remove_files(self) -> None:
        """(Under the lock) Keep the end of torchrun's log, let go of its lifeline, and
        remove the node's run dir and data folders."""
        self._last_words = self.tail()
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir.path, ignore_errors=True)
        for folder in self._folders:
            shutil.rmtree(folder, ignore_errors=True)


def _this_node() -> dict[str, Any]:
    """The agent's node: Ray's id for it, its address and host name, the name its ranks
    give it (the id tells apart nodes that share a host name), the GPUs Ray assigned."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    host = socket.gethostname()
    return {"node_id": node_id, "ip": ray.util.get_node_ip_address(), "host": host,
            "name": f"{host}:{node_id[:8]}", "gpus": [str(g) for g in ray.get_gpu_ids()]}


def _node_environment() -> dict[str, str]:
    """The ranks' environment on this node: the agent's, less what Ray sets for its own
    workers (``breakpoint()`` goes to nbddp's debugger, which answers in the notebook)."""
    env = dict(os.environ)
    if env.get("PYTHONBREAKPOINT", "").startswith("ray."):
        del env["PYTHONBREAKPOINT"]
    return env


def _reserved_node_folders() -> list[Path]:
    """The names of this node's private folders for the data files the kernel sends: in
    shared memory where there is some, and on local disk (the last one)."""
    shm = shm_root()
    disk = reserved_name("nbddp-node-", Path(tempfile.gettempdir()))
    return [disk] if shm is None else [reserved_name("nbddp-node-", shm), disk]


def _ended_early(starter: subprocess.Popen[bytes], said: str | None = None) -> str:
    """Why a node's torchrun ended before it started (what it said, as far as known)."""
    if said is None:
        assert starter.stdout is not None  # (a pipe)
        said = starter.stdout.read().decode(errors="replace")
    said = said.strip()[-2000:]
    return (f"torchrun ended before it started on this node (exit code "
            f"{starter.returncode})" + (f"; it said:\n{said}" if said else ""))


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _remove_own_placement_group() -> None:
    """Remove the placement group this actor runs in (which ends every agent of it)."""
    import ray
    from ray.util import get_current_placement_group, remove_placement_group

    group = get_current_placement_group()
    if group is not None:
        with contextlib.suppress(Exception):
            remove_placement_group(group)
    time.sleep(1.0)  # (the group's removal ends this actor; until then, nothing to do)
    with contextlib.suppress(Exception):
        ray.actor.exit_actor()
