"""A rank group's private directory: key, channel socket, payload, start file, logs.

A local group's run dir has a twin in shared memory (``/dev/shm``), of the same name
and as private, for data files: the payload's and results' tensor and array bytes.

The directory is 0700 and every file in it 0600, so only the user who launched the
ranks can read the payload or reach the channel. A local group's directory is temporary
and removed when the group ends; a rank writes its output here until its ``Start``
names the run's records folder. A cluster job's ranks run on other machines, so its
run directory is its records folder, on the shared filesystem; only its secrets are
removed.

Every file name of a run dir that both sides know is spelled here, once, and so are
those a rank writes that the run's records keep (``_run.records`` adds its own). A
cluster kind's own files live in its package (``_slurm.files``, ``_ray.session``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
import threading
from pathlib import Path
from typing import IO

from .dataplane import shm_root

_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux

PAYLOAD = "payload.pkl"
"""The run's code and arguments (private). In a cluster job's shared folder, also the
sign that the job may still run: it is removed when the run ends."""
KEY = "key"
"""The channel's secret: only its holders may talk to the kernel."""
SOCKET = "channel.sock"
"""A local group's channel, a Unix socket."""
RELAY_SOCKET = "relay.sock"
"""Where a node's relay listens for its ranks (``_rank.relay``); as long as ``SOCKET``."""
RELAY_ENV = "NBDDP_RELAY"
"""Set on a node's ranks whose relay is up: the socket they connect to."""
ADDRESS = "channel.address"
"""A cluster job's: ``host port`` of the kernel's TCP channel."""
START = "start.msg"
"""A cluster job's ``Start``, for ranks that cannot reach the kernel."""
NODE_FOLDER = "nbddp-node-{uid}-{job}.{step}-{node}"
"""The name of a cluster session node's data folders (in its shared memory and on its
local disk): the node's torchrun makes them, and the cluster's clean-up (SLURM's task
epilog) finds them by it."""
NODE_SHM_ENV = "NBDDP_NODE_SHM"
"""Names the node's data folder in shared memory to its ranks (set by nbddp's torchrun)."""
NODE_DISK_ENV = "NBDDP_NODE_DISK"
"""Names the node's data folder on local disk, for files that do not fit in memory."""
NODE_NAME_ENV = "NBDDP_NODE_NAME"
"""Names a node to its ranks, who say it in their hello (set by a Ray session's agent:
Ray's test nodes share one host name, so the name carries Ray's node id)."""
LAUNCHER_LOG = "torchrun.log"
"""torchrun's own output (a batch job's too); kept with the run's records."""
METRICS = "metrics.jsonl"
"""The rank-averaged metrics history, one JSON row per step (also a script run's)."""
STOP_FILE_ENV = "NBDDP_STOP_FILE"
"""Names the stop file for the ranks (set by a batch job's script, which empties it
each run and which the cluster's signal fills)."""
REQUEUE_FILE_ENV = "NBDDP_REQUEUE_FILE"
"""Names the requeue file for the ranks (set by a batch job's script): a rank's
``requeue()`` writes it, and the script requeues the job."""


def address_text(host: str, port: int | None) -> bytes:
    """What the address file says: ``host port`` of the kernel's TCP channel (a TCP
    server's port, never None)."""
    return f"{host} {port}".encode()


def parse_address(text: str) -> tuple[str, int]:
    """The ``(host, port)`` an address file names (ValueError if it names none)."""
    host, port = text.split()
    return host, int(port)


def rank_log_name(rank: int) -> str:
    """A rank's output: in the run dir until its ``Start`` names the records, then there."""
    return f"rank-{rank}.log"


def mailbox_name(rank: int) -> str:
    """A cluster job's rank's messages, for a kernel that it cannot reach (``_wire.mailbox``)."""
    return f"rank-{rank}.messages"


def _stacks_name(rank: int) -> str:
    return f"stacks-{rank}.txt"


LIFELINE_GO = b"g"
"""What the kernel (or a Ray node's agent) writes on torchrun's lifeline once it made
the run dir (an agent: and the node's data folders): until then torchrun waits, and if
the writer dies first, removes what it made of them."""
LIFELINE_ABANDON = b"x"
"""... or once it found a name taken: torchrun ends, removing nothing."""

_FAILURES = "failures-{}.json"  # one per torchrun: its host and PID
_TORCHRUN_LOGS = "torchelastic-{}"


class RunDir:
    """Paths of one rank group's files; a run dir made by ``make`` is private to the user."""

    def __init__(self, path: Path, shared: bool = False, twin: Path | None = None) -> None:
        self.path = path
        self.shared = shared
        """A cluster job's run dir: it is the records folder, and outlives the run."""
        self.twin = twin
        """Its twin in shared memory, for data files (tensors, arrays), if there is one."""
        self.payload = path / PAYLOAD
        self.key = path / KEY
        self.socket = path / SOCKET
        self.relay_socket = path / RELAY_SOCKET
        self.address = path / ADDRESS
        self.start = path / START
        self.launcher_log = path / LAUNCHER_LOG

    @classmethod
    def reserve(cls) -> RunDir:
        """A new run dir's name, nobody else's (64 random bits), with nothing made yet:
        its torchrun starts first, so that whatever the kernel then makes has someone
        to remove it if the kernel dies (``make``; the lifeline's words below)."""
        path = reserved_name("nbddp-", Path(tempfile.gettempdir()))
        name = path.name
        if len(str(path / SOCKET)) > _MAX_SOCKET_PATH:
            path = Path("/tmp") / name
        return cls.named(path)

    @classmethod
    def named(cls, path: Path) -> RunDir:
        """The local run dir at ``path``, and where its twin is, if there is shared
        memory (in a process started with the same environment: found the same way)."""
        root = shm_root()
        return cls(path, twin=None if root is None else root / path.name)

    def make(self) -> None:
        """Make the run dir, private to the user (0700), and its twin where it can be
        made; ``FileExistsError`` if the name is taken."""
        os.mkdir(self.path, 0o700)
        if self.twin is not None:
            try:
                self.twin.mkdir(mode=0o700)
            except OSError:
                self.twin = None

    @classmethod
    def of_job(cls, path: Path) -> RunDir:
        """The run dir of a cluster job, which is also its records folder."""
        return cls(path, shared=True)

    def stacks_file(self, rank: int) -> Path:
        """Where a rank dumps its threads' stacks when asked (``Job.stacks``)."""
        return self.path / _stacks_name(rank)

    def rank_log(self, rank: int) -> Path:
        """Where a rank writes its output until its ``Start`` names the run's records."""
        return self.path / rank_log_name(rank)

    def failures_file(self) -> Path:
        """Where this torchrun (one per machine) records how its ranks ended."""
        return self.path / _FAILURES.format(_this_torchrun())

    def torchrun_log_dir(self) -> Path:
        """This torchrun's own log dir (``--log-dir``), kept inside the run dir."""
        return self.path / _TORCHRUN_LOGS.format(_this_torchrun())

    def failure_files(self) -> list[Path]:
        return sorted(self.path.glob(_FAILURES.format("*")))

    def write_private(self, path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    def append_to_launcher_log(self) -> int:
        """The launcher's log, opened to append (made private if new): the kernel keeps
        what torchrun said before it could open it itself, and torchrun the rest."""
        return os.open(self.launcher_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def keep_early_output(self, output: IO[bytes]) -> threading.Thread:
        """Append what the launcher wrote to ``output`` before its run dir was made (a
        Python that cannot start it, say), and after until it sends its output to the
        log itself (or ends), to the log; the thread that does it."""
        log = self.append_to_launcher_log()

        def keep() -> None:
            with output, open(log, "ab") as kept:
                shutil.copyfileobj(output, kept)

        thread = threading.Thread(target=keep, daemon=True, name="nbddp-launcher-output")
        thread.start()
        return thread

    def replace_private(self, path: Path, data: bytes) -> None:
        """Write ``path`` anew (0600), in one step for its readers."""
        fresh = path.with_name(f".{path.name}.{os.getpid()}")
        fresh.unlink(missing_ok=True)
        self.write_private(fresh, data)
        os.replace(fresh, path)

    def remove(self) -> None:
        """Remove the run dir; a shared one (the records) keeps all but its secrets."""
        if self.shared:
            for secret in (self.payload, self.key, self.address, self.start):
                secret.unlink(missing_ok=True)
        else:
            shutil.rmtree(self.path, ignore_errors=True)
        self.remove_twin()

    def remove_twin(self) -> None:
        """Remove the twin in shared memory (its data files), if there is one."""
        if self.twin is not None:
            shutil.rmtree(self.twin, ignore_errors=True)


def reserved_name(prefix: str, parent: Path) -> Path:
    """A new name in ``parent``, nobody else's (64 random bits), with nothing made yet."""
    return parent / f"{prefix}{secrets.token_hex(8)}"


def read_own_key(folder: Path) -> bytes:
    """The key in ``folder``, read only if the folder and the key are this user's and
    nobody else's (no symlink, mode 0700 and 0600 or stricter): a folder that someone
    else made or can write to could hold a key of theirs, which would let them in.
    PermissionError otherwise."""
    flags = os.O_RDONLY | os.O_NOFOLLOW
    directory = os.open(folder, flags | os.O_DIRECTORY)
    try:
        _check_own(os.fstat(directory), folder)
        key = os.open(KEY, flags, dir_fd=directory)
        try:
            _check_own(os.fstat(key), folder / KEY)
            with os.fdopen(os.dup(key), "rb") as f:
                return f.read()
        finally:
            os.close(key)
    finally:
        os.close(directory)


def _check_own(status: os.stat_result, path: Path) -> None:
    if status.st_uid != os.getuid() or status.st_mode & 0o077:
        raise PermissionError(f"{path} is not this user's alone (owner uid {status.st_uid}, "
                              f"mode {status.st_mode & 0o777:o})")


def _this_torchrun() -> str:
    """Names the files of one machine's torchrun apart from another's (SLURM's virtual
    nodes can share a host name, so the PID goes in too)."""
    return f"{socket.gethostname()}-{os.getpid()}"
