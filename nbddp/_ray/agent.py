"""A Ray session's agent: one small actor per node, which starts the node's torchrun and
owns its end.

Ray places the agent in its node's bundle of the session's placement group, and kills
only an actor's own process: torchrun, in a process session of its own, would outlive
it. So the agent holds torchrun's lifeline (``nbddp._torchrun``): whenever the agent
ends (stopped, killed with ``ray.kill``, its node's raylet gone, the kernel's job over),
the pipe closes and torchrun stops its ranks and removes the node's run dir. ``stop``
ends it first, in order.

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
from .._wire.rundir import LIFELINE_GO, NODE_DISK_ENV, NODE_NAME_ENV, NODE_SHM_ENV, RunDir
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
        """Make the node's run dir (key, kernel's address), and start torchrun on
        ``torchrun_args`` and nbddp's worker; the run dir's path."""
        with self._lock:
            if self.torchrun_group is not None:
                raise RuntimeError("this node's torchrun was started already")
            path = Path(tempfile.mkdtemp(prefix="nbddp-ray-"))  # 0700
            run_dir = self.run_dir = RunDir(path)
            run_dir.write_private(run_dir.key, key)
            run_dir.write_private(run_dir.address, address)
            self._folders = _node_folders()
            where = self._node
            ranks_env = {**_node_environment(), **env, NODE_NAME_ENV: where["name"],
                         NODE_SHM_ENV: str(self._folders[0]),
                         NODE_DISK_ENV: str(self._folders[-1])}
            if len(self._folders) == 1:
                ranks_env.pop(NODE_SHM_ENV)
            if where["gpus"]:
                ranks_env["CUDA_VISIBLE_DEVICES"] = ",".join(where["gpus"])
            read_end, self._lifeline = os.pipe()
            self._report, report = os.pipe()
            command = [sys.executable, "-m", "nbddp._torchrun", str(path), str(read_end),
                       "--node-data", "--report", str(report), *torchrun_args,
                       "-m", "nbddp._worker", str(path), *worker_args]
            log = run_dir.append_to_launcher_log()
            try:
                starter = subprocess.Popen(
                    command, env=ranks_env, cwd=cwd if cwd and os.path.isdir(cwd) else None,
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    pass_fds=(read_end, report), start_new_session=True)
            finally:
                for fd in (log, read_end, report):
                    os.close(fd)
            starter.wait()  # (it goes on in a child: see nbddp._torchrun's --report)
            self.torchrun_group = starter.pid
            os.write(self._lifeline, LIFELINE_GO)
            threading.Thread(target=self._watch, daemon=True, name="nbddp-torchrun").start()
        return str(path)

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
        files: nothing of the session is left on this node."""
        self._stopping = True
        group = self.torchrun_group
        if group is not None and not self._ended.is_set():
            _signal_group(group, signal.SIGTERM)
            if not self._ended.wait(_TERM_WAIT):
                _signal_group(group, signal.SIGKILL)  # (its ranks die with it)
                self._ended.wait(_TERM_WAIT)
        self._clean_up()

    def _clean_up(self) -> None:
        with self._lock:
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


def _node_folders() -> list[Path]:
    """This node's private folders for the data files the kernel sends: in shared memory
    where there is some, and on local disk (the last one)."""
    folders = []
    shm = shm_root()
    if shm is not None:
        folders.append(Path(tempfile.mkdtemp(prefix="nbddp-node-", dir=shm)))
    folders.append(Path(tempfile.mkdtemp(prefix="nbddp-node-")))
    return folders


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
