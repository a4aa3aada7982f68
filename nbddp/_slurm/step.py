"""A session inside the allocation the kernel runs in: its ranks as a job step (``srun``).

A kernel started by ``salloc``, or by a Jupyter server that a batch job runs, is inside
an allocation: its nodes are held already. A session there runs ``srun`` from the
kernel, one task per node of the allocation, instead of submitting a job of its own:
nothing waits in the queue. The step gets a clean environment (none of the allocation's
variables but its id, given to ``srun`` on its command line), as launches do. The step
is stopped as ``srun`` is asked to stop one (SIGTERM, which it passes on to the tasks);
``srun`` runs in a session of its own, so that it outlives the kernel for a new kernel to
attach to its ranks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from .._errors import NbddpError
from .._run.groups.shape import GroupShape
from .._wire.rundir import RunDir
from .files import NODE_EPILOG
from .launcher import scancel, stopped_by_slurm
from .options import PORT_BASE, PORT_SPAN, SlurmOptions
from .sbatch import session_torchrun, session_worker

logger = logging.getLogger(__name__)

_STOP_WAIT = 30.0  # srun passes SIGTERM on, then SLURM's KillWait, then SIGKILL
_COMMAND_TIMEOUT = 60.0
_TERM_WAIT = 10.0  # how long a step may take to end after SIGTERM
_POLL_INTERVAL = 1.0  # squeue --steps, while attached to a step


@dataclass(frozen=True)
class Allocation:
    """The SLURM allocation this kernel runs in."""

    job_id: str
    nodes: int
    nodelist: str

    @classmethod
    def here(cls) -> Allocation | None:
        """The kernel's allocation, from the variables SLURM gives its processes."""
        job_id = os.environ.get("SLURM_JOB_ID")
        nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
        if not (job_id and nodes and nodes.isdigit() and nodelist):
            return None
        return cls(job_id, int(nodes), nodelist)

    def first_node(self) -> str:
        """The host of the rendezvous (``scontrol show hostnames``' first)."""
        try:
            done = subprocess.run(["scontrol", "show", "hostnames", self.nodelist],
                                  capture_output=True, text=True, timeout=_COMMAND_TIMEOUT,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NbddpError(f"scontrol show hostnames {self.nodelist} failed: {exc}") from None
        names = done.stdout.split()
        if done.returncode != 0 or not names:
            raise NbddpError(f"scontrol show hostnames {self.nodelist} failed: "
                             f"{done.stderr.strip()}")
        return names[0]

    def check(self, options: SlurmOptions) -> None:
        """A session in the allocation runs on all of its nodes, as they are."""
        if options.nodes not in (1, self.nodes):
            raise ValueError(f"this kernel runs in SLURM allocation {self.job_id} of "
                             f"{self.nodes} nodes, and a session there runs on all of them: "
                             f"--nodes {options.nodes} asks for another number")
        asked = [name for name, value in (("time", options.time),
                                          ("partition", options.partition),
                                          ("sbatch", options.extra)) if value]
        if asked:
            raise ValueError(f"this kernel runs in SLURM allocation {self.job_id}: a session "
                             f"there is a job step of it, which takes no {', '.join(asked)}")


class AttachedStep:
    """A session's job step as SLURM knows it: found by its name among the allocation's
    steps, followed until it has ended, stopped with ``scancel`` of that step alone. How
    a kernel that attached follows a step an earlier kernel's ``srun`` started."""

    def __init__(self, job_id: str, name: str) -> None:
        self.job_id, self.name = job_id, name
        self._ended = threading.Event()
        self._released = False

    def _step_id(self) -> str | None:
        """``JOB.STEP`` of the session's step; None once it has ended."""
        try:
            done = subprocess.run(["squeue", "--steps", "--noheader", f"--jobs={self.job_id}",
                                   "--format=%i|%j"], capture_output=True, text=True,
                                  timeout=_COMMAND_TIMEOUT, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return ""  # unknown: ask again
        if done.returncode != 0:
            return None if "Invalid job id" in done.stderr else ""
        for line in done.stdout.splitlines():
            step, _, name = line.strip().partition("|")
            if name == self.name:
                return step
        return None

    def add_rank(self, pid: int) -> None:
        """Ranks run on the allocation's nodes: the step stops them, not their PIDs."""

    def running(self) -> bool:
        return self._step_id() is not None

    def release(self) -> None:
        """Stop following the step (a kernel that detached): ``wait`` returns."""
        self._released = True
        self._ended.set()

    def wait(self) -> int:
        while not self._released and self._step_id() is not None:
            self._ended.wait(_POLL_INTERVAL)
        self._ended.set()
        return 0

    def stop(self, clean: bool = False) -> None:
        """``scancel`` the step (asked again while SLURM does not answer), and wait until
        it has gone. SIGTERM first, as ``srun`` passes it on: nbddp's torchrun on each
        node then stops its ranks and removes the node's data folders; a step still
        there after ``_TERM_WAIT`` s is killed."""
        start, asked = time.monotonic(), False
        while time.monotonic() < start + _STOP_WAIT:
            step = self._step_id()
            if step is None:
                return
            if step and not asked:
                asked = scancel(step, "--signal=TERM")  # once: a second one would cut
            elif step and time.monotonic() > start + _TERM_WAIT:  # the clean-up short
                scancel(step)
            time.sleep(_POLL_INTERVAL)
        logger.warning("nbddp: job step %s of SLURM job %s still runs %s s after scancel",
                       self.name, self.job_id, _STOP_WAIT)

    def stopped_from_outside(self) -> str | None:
        return stopped_by_slurm(self.job_id)


class JobStep(AttachedStep):
    """The session's ``srun`` in the allocation, started by this kernel: followed by its
    process, stopped by signalling it (and, should ``srun`` not end, as any step)."""

    def __init__(self, allocation: Allocation, run_dir: RunDir, shape: GroupShape,
                 options: SlurmOptions, grace: float | None) -> None:
        super().__init__(allocation.job_id, f"nbddp-session-{secrets.token_hex(4)}")
        head = allocation.first_node()
        port = PORT_BASE + secrets.randbelow(PORT_SPAN)  # apart from the job's own steps
        command = [
            "srun", f"--jobid={allocation.job_id}", f"--job-name={self.name}",
            f"--nodes={allocation.nodes}",
            "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            "--overlap",  # beside the step the kernel itself may run in (srun jupyter ...)
            f"--task-epilog={run_dir.path / NODE_EPILOG}",
            *([f"--cpus-per-task={options.cpus_per_task}"] if options.cpus_per_task else []),
            *session_torchrun(str(run_dir.path), shape.python, allocation.nodes,
                              options.nprocs_per_node),
            "--rdzv-id", f"nbddp-{allocation.job_id}-{port}", "--rdzv-endpoint", f"{head}:{port}",
            *session_worker(str(run_dir.path), shape.prepare, grace),
        ]
        log = os.open(run_dir.launcher_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self.process = subprocess.Popen(
                command, env=dict(shape.env), cwd=shape.cwd, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except FileNotFoundError:
            raise NbddpError("srun not found: a session inside a SLURM allocation needs "
                             "SLURM's commands on PATH") from None
        finally:
            os.close(log)

    def release(self) -> None:
        """The kernel detached: ``srun`` goes on (in its own session), for another."""

    def wait(self) -> int:
        return self.process.wait()

    def stop(self, clean: bool = False) -> None:
        """End the step: SIGTERM to ``srun`` (it stops the tasks on every node), SIGKILL
        if it has not ended within ``_STOP_WAIT`` s, and then ``scancel`` its tasks."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(_STOP_WAIT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                super().stop()
