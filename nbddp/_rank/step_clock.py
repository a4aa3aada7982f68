"""Where a rank's steps go: waiting for the next batch, the step itself, and the part of
the step spent waiting in DDP's gradient all-reduce.

The loop's own boundaries mark the steps: ``nbddp.progress`` asks for the next batch
(the step before has ended) and gets it (a step begins); the framework integrations mark
theirs (Lightning's batch start and end, the Trainer's step begin and end). Nothing
inside the step is wrapped or timed by nbddp.

The time in collectives comes from DDP's own timers. For sampled iterations its reducer
measures how long the gradients' all-reduce ran and how much of that overlapped the
backward's computation; the rest is time the step waited on the other ranks (or the
network). nbddp finds the DDP models through a global forward pre-hook that stays for
the first few steps of a loop only, asks each model to sample every ``SAMPLE_EVERY``th
iteration, and reads the samples on the training thread, between steps, every
``SAMPLE_EVERY``th step (a read is not free). A step is taken to hold one
synchronised iteration per model.

The totals only grow; the reporting thread reads them whole (one tuple, replaced at
each step) about once a second.
"""

from __future__ import annotations

import contextlib
import sys
import time
import weakref
from typing import Any, NamedTuple

SAMPLE_EVERY = 10
"""DDP's timers sample every this many iterations; the clock reads them as often."""
LOOK_FOR_MODELS = 3
"""Steps of a loop during which a DDP model's first forward is looked for."""

_models: weakref.WeakSet[Any] = weakref.WeakSet()
"""The DDP models this process has seen (a session's ranks keep theirs across cells)."""


class StepTotals(NamedTuple):
    """A rank's steps since its run began, and where their time went (seconds)."""

    steps: int = 0
    data_s: float = 0.0
    """Waiting for the next batch."""
    step_s: float = 0.0
    """In the steps (computation and collectives both)."""
    comm_s: float = 0.0
    """DDP's measured wait in the gradient all-reduce, summed over sampled steps."""
    comm_samples: int = 0
    """How many steps ``comm_s`` covers."""


_NO_STEPS = StepTotals()


class StepClock:
    """One rank's step timings, marked by the training loop's thread."""

    def __init__(self) -> None:
        self.totals = StepTotals()
        self._asked: float | None = None
        self._began: float | None = None
        self._loop_steps = 0
        self._watch = _ModelWatch()

    @property
    def fresh(self) -> bool:
        """Nothing a later run would inherit is on this clock (no step, no wait, no
        loop under way): it is as a new one."""
        return (self._asked is None and self._began is None and self._watch.idle
                and self.totals == _NO_STEPS)

    def batch_asked(self) -> None:
        """The loop asks for its next batch: the step before (if any) has ended."""
        now = time.perf_counter()
        if self._began is not None:
            self._step_ended(now - self._began)
            self._began = None
        elif self._asked is None:
            self._loop_begins()
        self._asked = now

    def batch_ready(self) -> None:
        """The batch came: a step begins, and the wait for it is data time."""
        now = time.perf_counter()
        if self._asked is None and self._began is None:  # a framework's first step
            self._loop_begins()
        waited = now - self._asked if self._asked is not None else 0.0
        self._asked, self._began = None, now
        t = self.totals
        self.totals = StepTotals(t.steps, t.data_s + waited, t.step_s, t.comm_s, t.comm_samples)

    def loop_ended(self) -> None:
        """The loop ran out of batches or paused (a framework validates): what comes
        until the next step is no wait for data."""
        self._asked = self._began = None
        self._watch.disarm()

    def _loop_begins(self) -> None:
        self._loop_steps = 0
        self._watch.arm()

    def _step_ended(self, seconds: float) -> None:
        t = self.totals
        self._loop_steps += 1
        comm, samples = 0.0, 0
        if self._loop_steps == LOOK_FOR_MODELS:
            self._watch.disarm()
        if self._loop_steps in (2, 5) or self._loop_steps % SAMPLE_EVERY == 0:
            comm, samples = self._watch.new_wait()
        self.totals = StepTotals(t.steps + 1, t.data_s, t.step_s + seconds,
                                 t.comm_s + comm, t.comm_samples + samples)


class _ModelWatch:
    """Finds the DDP models a loop trains and reads their timers' latest samples."""

    def __init__(self) -> None:
        self._hook: Any = None
        self._seen: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        """Per model, the iteration whose sample was last read."""

    def arm(self) -> None:
        """Look at the next forwards for DDP models (until ``disarm``)."""
        if self._hook is not None:
            return
        torch = sys.modules.get("torch")
        if torch is None:
            return
        for model in list(_models):  # what they sampled before this loop is not its own
            sample = _latest_sample(model)
            if sample is not None:
                self._seen[model] = sample[0]
        try:
            self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._spot)
        except (AttributeError, RuntimeError):  # pragma: no cover - an old torch
            self._hook = None

    @property
    def idle(self) -> bool:
        """Not looking for models (``arm`` looks afresh)."""
        return self._hook is None

    def disarm(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @staticmethod
    def _spot(module: Any, args: Any) -> None:
        ddp = sys.modules["torch"].nn.parallel.DistributedDataParallel
        if isinstance(module, ddp) and module not in _models:
            _models.add(module)
            with contextlib.suppress(AttributeError, RuntimeError):  # (an old torch)
                module._set_ddp_runtime_logging_sample_rate(SAMPLE_EVERY)

    def new_wait(self) -> tuple[float, int]:
        """The gradient all-reduce wait of the models' samples new since the last read
        (seconds, summed over models), and 1; or ``(0.0, 0)`` where none is new."""
        wait, new = 0.0, False
        for model in list(_models):
            sample = _latest_sample(model)
            if sample is None or self._seen.get(model) == sample[0]:
                continue
            self._seen[model] = sample[0]
            wait, new = wait + sample[1], True
        return (wait, 1) if new else (0.0, 0)


def _latest_sample(model: Any) -> tuple[int, float] | None:
    """``(iteration, seconds)``: DDP's last sampled iteration, and how long its
    gradient all-reduce ran beyond the backward's computation."""
    try:
        data = model._get_ddp_logging_data()
    except (AttributeError, RuntimeError):
        return None
    iteration, comm = data.get("iteration"), data.get("backward_comm_time")
    if not iteration or comm is None:
        return None
    overlap = data.get("backward_compute_comm_overlap_time", 0)
    return int(iteration), max(0, int(comm) - int(overlap)) / 1e9
