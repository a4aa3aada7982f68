"""The public surface is what __init__ exports, and importing it stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

import nbddp


def test_all_is_pinned():
    assert nbddp.__all__ == ["Job", "NbddpError", "PayloadError", "Ray", "Session",
                             "SessionStatus", "Slurm", "StandbyState", "WorkerError",
                             "attach", "export", "last_job", "launch", "log", "progress",
                             "requeue",
                             "restart_count", "standby", "stop_requested"]
    for name in nbddp.__all__:
        assert getattr(nbddp, name).__module__.startswith("nbddp.")


def test_error_hierarchy():
    assert issubclass(nbddp.WorkerError, nbddp.NbddpError)
    assert issubclass(nbddp.PayloadError, nbddp.NbddpError)
    assert issubclass(nbddp.PayloadError, TypeError)


@pytest.mark.fast
def test_importing_nbddp_does_not_import_torch_or_configure_logging():
    code = ("import logging, sys, nbddp; "
            "print('torch' in sys.modules, logging.getLogger().handlers)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False []"


@pytest.mark.fast
def test_ray_is_imported_only_when_a_ray_run_starts():
    """``nbddp.Ray`` and a local session's front door never load ray (an optional extra:
    ``nbddp[ray]``); only a run or session on Ray does."""
    code = ("import sys, nbddp, nbddp._session, nbddp._magic; options = nbddp.Ray(nodes=2); "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def test_worker_error_pickles_and_keeps_its_details():
    import pickle

    error = nbddp.WorkerError(1, "raised ValueError: x", traceback="tb", exitcode=1,
                              logs={0: "a", 1: "b"})
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.rank, copy.traceback, copy.exitcode, copy.logs) == (1, "tb", 1, {0: "a", 1: "b"})
    assert str(copy) == str(error)


KERNEL_SIDE = ("nbddp._run", "nbddp._panel", "nbddp._local", "nbddp._slurm", "nbddp._ray",
               "nbddp._export",
               "nbddp._launch", "nbddp._session", "nbddp._magic",
               "nbddp._wire.cell_names", "nbddp._wire.history")
"""The kernel's packages and modules, and the two of ``_wire`` only the kernel needs
(a rank of a script reads history, a cell's names are picked in the kernel)."""


def loaded_nbddp_modules():
    import sys

    return sorted(name for name in sys.modules if name.startswith("nbddp"))


@pytest.mark.fast
def test_ranks_load_none_of_the_kernel_side():
    """A rank runs ``python -m nbddp._worker``: it must not load the kernel's machinery
    (the launcher, the panel, SLURM), only what talks to the kernel and runs the code."""
    on_rank = nbddp.launch(loaded_nbddp_modules, 2)
    assert "nbddp._rank.link" in on_rank  # (the worker itself runs as __main__)
    loaded = [name for name in on_rank
              if any(name == side or name.startswith(side + ".") for side in KERNEL_SIDE)]
    assert loaded == [], on_rank
