"""nbddp: run PyTorch DistributedDataParallel from a Jupyter notebook."""

from ._errors import NbddpError, PayloadError, WorkerError
from ._export import export
from ._job import Job
from ._launch import attach, last_job, launch
from ._metrics import log, progress
from ._slurm import Slurm

__version__ = "0.1.0"

__all__ = [
    "Job",
    "NbddpError",
    "PayloadError",
    "Slurm",
    "WorkerError",
    "attach",
    "export",
    "last_job",
    "launch",
    "log",
    "progress",
]


def load_ipython_extension(ipython) -> None:  # noqa: ANN001 - IPython's hook
    """``%load_ext nbddp`` registers the ``%%ddp`` cell magic."""
    from ._magic import load_ipython_extension as load

    load(ipython)
