"""The files a SLURM job keeps in its run folder, besides every run's (``_wire.rundir``).

A SLURM job's run folder is on the shared filesystem and outlives the kernel: it holds
what a new kernel needs to follow the job or attach to its session again, the batch
script, and the files through which SLURM's signals and a rank's ``requeue()`` reach the
batch script. Each name is spelled here, once; the kernel and the sbatch text take them
from this module.
"""

from __future__ import annotations

JOB = "job.json"
"""A submitted job's id and shape, to follow it again from a new kernel."""
SBATCH = "job.sbatch"
"""The job's batch script."""
SESSION = "session.json"
"""A session's job id and shape, for a kernel that attaches to it."""
NODE_EPILOG = "node-epilog"
"""A session's task epilog: SLURM runs it on each node however the node's torchrun
ended (a SIGKILL too), and it removes that node's data folders (``NODE_FOLDER``)."""
STOP_FILE = "stop-requested"
"""Empty until SLURM's signal; the batch script empties it each run (the ranks find it
by ``STOP_FILE_ENV``)."""
REQUEUE_FILE = "requeue-requested"
"""A rank ended with ``requeue()``; the batch script requeues the job."""
