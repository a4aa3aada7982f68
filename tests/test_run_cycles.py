"""A session's run leaves nothing for Python's garbage collector: once its ``Job`` is
dropped, every object the run made goes by reference counting. (Each run used to leave
a hundred objects in reference cycles: in a loop of quick cells the kernel then paid a
collection every few cells, and a large kernel's heap makes the older collections slow.)
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator

import pytest

import nbddp
from nbddp._run import run_panel

from .conftest import wait_until

pytestmark = pytest.mark.slow  # a session's ranks start


@pytest.fixture
def collector_off() -> Iterator[None]:
    """Only reference counting frees anything while the test runs."""
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def noop() -> None:
    """The run."""


def submitted(session: nbddp.Session) -> nbddp.Job:
    """A run followed by a thread (``submit``), waited for."""
    job = session.submit(noop)
    job.result()
    return job


def run_here(session: nbddp.Session) -> nbddp.Job:
    """A run followed by its caller (``run``: a quick run ends in the caller's thread)."""
    session.run(noop)
    job = nbddp.last_job()
    assert job is not None
    return job


@pytest.mark.parametrize("output, many_ranks, how", [
    ("none", False, submitted), ("rank0", False, submitted), ("rank0", True, submitted),
    ("none", False, run_here), ("rank0", False, run_here)])
def test_a_runs_objects_go_with_its_job(output, many_ranks, how, collector_off, capsys,
                                        monkeypatch):
    monkeypatch.setenv("NBDDP_DISPLAY", "text")
    if many_ranks:  # (the panel of many ranks keeps a way to every rank's note)
        monkeypatch.setattr(run_panel, "MANY_RANKS", 1)
    with nbddp.Session(nprocs=2, output=output) as session:
        session.run(noop)  # (the first run joins the process group)
        gc.collect()  # (what starting the session left)
        jobs = []
        for _ in range(3):
            job = how(session)
            jobs.append((weakref.ref(job), weakref.ref(job._supervisor)))
            del job
        # (last_job() keeps the last; the one before it is let go in a follower thread)
        earlier = jobs[:-1]
        with contextlib.suppress(AssertionError):
            wait_until(lambda: all(job() is None and sup() is None for job, sup in earlier),
                       timeout=10)
        left = [(job(), sup()) for job, sup in earlier]
        assert left == [(None, None)] * 2, f"{gc.collect()} objects were left in cycles"
        assert jobs[-1][0]() is not None
