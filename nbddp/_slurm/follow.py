"""Following a SLURM job's run: its queue state, its requeues, its time limit.

What a batch job adds to a run, as ``GroupHooks`` for its supervisor: the job's state
(queued and why, then where it runs); SLURM's warning that the time limit nears; ranks
that asked for a requeue (``nbddp.requeue()``); and the job's requeues, each of which
runs it again from the start. The notebook then follows the next run: it notices it by
the ranks' messages (each says which requeue sent it), by SLURM's count in the job's
state, or, when a rank fails, by asking SLURM whether a requeue is what stopped it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._errors import NbddpError
from .._run.attempts import Attempt
from .._run.groups.group import GroupHooks
from .._wire.messages import Requeueing, StopRequested
from .launcher import JobStatus, job_status

if TYPE_CHECKING:
    from .._run.supervisor import Supervisor


class RequeueCount:
    """How many times SLURM has requeued a job, as the notebook learns it."""

    def __init__(self) -> None:
        self.seen = 0
        """The latest requeue that the ranks' messages came from."""

    def saw(self, message: Any) -> None:
        """A rank's message was delivered (on a link's thread)."""
        self.seen = max(self.seen, getattr(message, "requeue", 0))

    def now(self, job_id: str) -> int:
        """SLURM's count, asked now (a rank's failure may be the requeue's doing), or what
        the ranks' messages show if SLURM no longer knows the job."""
        try:
            restarts = job_status(job_id).restarts
        except NbddpError:
            restarts = 0
        return max(restarts, self.seen)


class SlurmHooks(GroupHooks):
    """A SLURM job's part in following its run (see the module's docstring)."""

    supervisor: Supervisor

    def __init__(self, supervisor: Supervisor, job_id: str, requeues: RequeueCount) -> None:
        super().__init__(supervisor)
        self.job_id, self.requeues = job_id, requeues
        self._stop_said = False
        supervisor.state.status = "queued"
        if requeues.seen:  # attached to a job that ran before: follow its latest run
            supervisor.attempt = Attempt(supervisor.config.nprocs, requeue=requeues.seen)
        pump = supervisor.pump
        pump.on(JobStatus, self._show_status)
        pump.on(StopRequested, self._stop_requested)
        pump.on(Requeueing, self._requeueing)
        pump.on_arrival(self._arrived)

    def requeued(self, requeue: int) -> None:
        """SLURM put the job back in the queue: the notebook follows its next run (which
        starts the function again)."""
        self.supervisor.state.status = "requeued"
        self.supervisor.new_attempt(requeue, 0, f"requeue {requeue}",
                                    f"nbddp: SLURM job {self.job_id} was requeued "
                                    f"(requeue {requeue}); following its next run\n")

    def _arrived(self, message: Any) -> None:
        if message.requeue > self.supervisor.attempt.requeue:
            self.requeued(message.requeue)  # the ranks of the job's next run speak first

    def moved_on(self) -> bool:
        """A rank failed: true if SLURM is requeueing the job, which stops its ranks
        (then the failure is not the run's end); follows the next run if so."""
        requeues = self.requeues.now(self.job_id)
        if requeues > self.supervisor.attempt.requeue:
            self.requeued(requeues)
            return True
        return False

    def ended_early(self) -> BaseException | None:
        """The ranks asked for a requeue, but the job ended instead."""
        attempt, group = self.supervisor.attempt, self.supervisor.group
        if attempt.requeueing and not attempt.failures:
            return NbddpError(
                f"the ranks called nbddp.requeue(), but {group.where} ended instead of "
                f"going back to the queue; see {self.supervisor.records.launcher_log}")
        return None

    def _requeueing(self, report: Requeueing) -> None:
        self.supervisor.state.message = ("the ranks called nbddp.requeue(): the job goes "
                                         "back to the queue")

    def _stop_requested(self, message: StopRequested) -> None:
        """SLURM's warning before the time limit reached the ranks (said once)."""
        if self._stop_said:
            return
        self._stop_said = True
        self.supervisor.state.message = ("time limit near: nbddp.stop_requested() is true "
                                         "on the ranks")
        self.supervisor.note_now(f"nbddp: SLURM job {self.job_id} nears its time limit; "
                                 "nbddp.stop_requested() is now true on the ranks\n")

    def _show_status(self, status: JobStatus) -> None:
        """Show the job's state: queued (and why), then where it runs."""
        supervisor = self.supervisor
        if status.restarts > supervisor.attempt.requeue:
            self.requeued(status.restarts)
        supervisor.output.write(f"nbddp: {status.describe(self.job_id)}\n")
        requeue = supervisor.attempt.requeue
        if status.state == "PENDING" and requeue:
            supervisor.state.message = f"requeue {requeue}, queued ({status.reason})"
        else:
            show_job_state(supervisor, status)


def show_job_state(supervisor: Supervisor, status: JobStatus) -> None:
    """The panel follows a job's state: queued (and why), then where it runs."""
    state = supervisor.state
    if status.state == "PENDING":
        state.status, state.message = "queued", status.reason
    elif status.state == "RUNNING":
        state.status, state.message = "running", f"on {status.nodes}"
        supervisor.view.touch()  # the time in the queue was no stall
