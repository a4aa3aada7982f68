"""A real two-node Ray cluster on this machine, for one test module.

Two ``ray start`` processes on ports of their own (1 CPU each, no dashboard, a temp dir
of their own), the second joining the first: two Ray nodes that share this machine's
address and host name (nbddp keys per-node state by Ray's node id). pytest is a child
subreaper, so every process the nodes start stays its descendant: each node's processes
are known by PID, a node is removed by killing its raylet's PID, and the cluster is
stopped by PID (never ``ray stop``, which stops every Ray on the machine by name).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .conftest import cmdline, descendants

RAY = shutil.which("ray")


def unavailable() -> str | None:
    """Why no Ray cluster can be started here, or None."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return "ray is not installed (pip install 'nbddp[ray]')"
    if RAY is None:
        return "the ray command is not on PATH"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RayCluster:
    """A head node and workers, started with ``ray start`` (see the module's docstring)."""

    def __init__(self) -> None:
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # (short: sockets)
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[set[int]] = []
        """Each node's processes (its raylet and Ray's agents beside it)."""
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}

    def start(self, nodes: int = 2, hidden: Path | None = None) -> RayCluster:
        """The head, and ``nodes - 1`` workers; ``hidden``: a folder the workers cannot
        see (as a pod does not see the notebook's folder)."""
        self._start_node(["--head", f"--port={self.port}", "--include-dashboard=false"])
        for _ in range(nodes - 1):
            self.add_node(hidden)
        return self

    def add_node(self, hidden: Path | None = None, env: dict[str, str] | None = None) -> None:
        """A worker node; ``hidden``: a folder it (and every process it starts) sees as
        empty: ``ray start`` runs in a mount namespace of its own (``unshare -m``, as
        root) with a tmpfs over that folder, which its raylet and workers inherit;
        ``env``: what its processes' environment adds."""
        self._start_node([f"--address={self.address}"], hidden, env)

    def _start_node(self, where: list[str], hidden: Path | None = None,
                    env: dict[str, str] | None = None) -> None:
        """Start a node; twice more if Ray gave up on it (a node's start waits a fixed
        time for its GCS, which a machine busy with the other lane can exceed). What a
        failed start left running is stopped at once: unknown to ``stop``, it would
        outlive the cluster, and every later test that looks at this process's
        descendants would see it."""
        index = len(self.nodes)
        for tries_left in (2, 1, 0):
            before = descendants()
            try:
                done = subprocess.run(
                    [*_hiding(hidden), RAY, "start", *where, "--num-cpus=1",
                     "--disable-usage-stats", f"--temp-dir={self.temp_dir}",
                     f"--resources={json.dumps({f'node{index}': 1})}"],
                    env={**self.env, **(env or {})}, capture_output=True, text=True,
                    timeout=120)
                said = f"{done.stdout}\n{done.stderr}"
            except subprocess.TimeoutExpired as timed_out:
                done, said = None, f"no answer in {timed_out.timeout} s"
            started = descendants() - before
            if done is not None and done.returncode == 0:
                self.nodes.append(started)
                return
            _stop_processes(started)
            assert tries_left, f"ray start failed: {said}"

    def raylet(self, index: int) -> int:
        """The PID of node ``index``'s raylet."""
        found = [pid for pid in self.nodes[index] if "raylet/raylet" in cmdline(pid)]
        assert found, f"no raylet among node {index}'s processes"
        return found[0]

    def kill_node(self, index: int) -> None:
        """Node ``index`` goes, as a machine that is lost: its raylet killed."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.raylet(index), signal.SIGKILL)

    def kill_everything_of_node(self, index: int) -> None:
        """Every process of node ``index`` (its raylet, Ray's workers, what they
        started) killed at once, as when a pod is evicted or its machine dies."""
        pids = self.nodes[index].union(*(descendants(pid) for pid in self.nodes[index]))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _stop_processes(pids)  # (reaped)
        self.nodes[index] = set()

    def stop_node(self, index: int) -> None:
        """Node ``index`` goes with every process it started, by PID (a node a test
        added for itself)."""
        _stop_processes(self.nodes[index])
        self.nodes[index] = set()

    def state(self) -> dict:
        """What the cluster holds of nbddp: live actors of the nbddp namespace, placement
        groups not removed (asked by a driver of its own, in a process of its own)."""
        script = f"""
import json, ray
ray.init(address={self.address!r}, logging_level="ERROR", log_to_driver=False)
actors = [a for a in ray._private.state.actors().values()
          if a.get("State") != "DEAD" and a.get("Name", "").startswith("nbddp-")]
groups = [g for g in ray.util.placement_group_table().values()
          if g.get("state") != "REMOVED" and g.get("name", "").startswith("nbddp-")]
print(json.dumps({{"actors": [a["Name"] for a in actors],
                   "placement_groups": [g["name"] for g in groups]}}))
"""
        done = subprocess.run([sys.executable, "-c", script], env=self.env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    def remove_sessions(self) -> None:
        """Remove every nbddp placement group (and so its agents): what a failed test
        left, gone before the next."""
        script = f"""
import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray._raylet import PlacementGroupID
ray.init(address={self.address!r}, logging_level="ERROR", log_to_driver=False)
for key, group in ray.util.placement_group_table().items():
    if group.get("state") != "REMOVED" and group.get("name", "").startswith("nbddp-"):
        remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(key))))
"""
        subprocess.run([sys.executable, "-c", script], env=self.env, capture_output=True,
                       text=True, timeout=120)

    def wait_empty(self, timeout: float = 60.0) -> dict:
        """Wait until no nbddp actor or placement group is left; what is left."""
        deadline = time.monotonic() + timeout
        state = self.state()
        while (state["actors"] or state["placement_groups"]) and time.monotonic() < deadline:
            time.sleep(0.5)
            state = self.state()
        return state

    def stop(self) -> None:
        """Every process of the cluster, by PID (and whatever they started since)."""
        _stop_processes(set().union(*self.nodes) if self.nodes else set())
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def hiding_unavailable() -> str | None:
    """Why a node cannot be started with a folder hidden from it here, or None."""
    if os.geteuid() != 0:
        return "hiding a folder from a Ray node needs root (unshare -m, mount)"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    return None


def _hiding(folder: Path | None) -> list[str]:
    """The command prefix that runs a command with ``folder`` hidden (empty)."""
    if folder is None:
        return []
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs -o mode=0755 nbddp-hidden "$0" && exec "$@"', str(folder)]


def _stop_processes(started: set[int]) -> None:
    """Stop ``started`` and whatever they started, by PID: SIGTERM, then SIGKILL."""
    pids = started.union(*(descendants(pid) for pid in started))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
            descendants()  # (reaps the zombies adopted by pytest)


def _alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] not in "ZX"
