"""Bad input gets a clear error before any process starts."""

from __future__ import annotations

import threading
import warnings

import pytest

import nbddp
from nbddp._run.config import CPU_DEFAULT_NPROCS, RunOptions
from nbddp._wire import payload as _payload

from .conftest import descendants, run_dirs

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


@pytest.fixture
def nothing_starts():
    """The error must come before any process or run directory exists."""
    procs, dirs = descendants(), run_dirs()
    yield
    assert descendants() == procs
    assert run_dirs() == dirs


@pytest.mark.parametrize("nprocs, error, match", [
    (0, ValueError, "nprocs must be at least 1"),
    (-2, ValueError, "nprocs must be at least 1"),
    (1.5, TypeError, "nprocs must be an int"),
])
def test_bad_nprocs(nothing_starts, nprocs, error, match):
    with pytest.raises(error, match=match):
        nbddp.launch(print, nprocs)


def test_more_gpus_than_visible_says_how_to_run_on_cpu(nothing_starts, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, whatever the machine has
    with pytest.raises(ValueError, match=r"only 0 GPU\(s\) are visible.*nprocs=N"):
        nbddp.launch(print, gpus=2)
    with pytest.raises(ValueError, match="needs GPUs"):
        nbddp.launch(print, 2, backend="nccl")


def test_gpu_indices_are_validated(nothing_starts):
    with pytest.raises(ValueError, match="twice"):
        RunOptions(gpus=[0, 0]).on_this_machine()
    with pytest.raises(TypeError, match="gpus must be"):
        RunOptions(gpus="0,1").on_this_machine()


@pytest.mark.parametrize("options, match", [
    ({"timeout": 0}, "timeout must be a positive"),
    ({"timeout": "soon"}, "timeout must be a positive"),
    ({"backend": ""}, "backend must be"),
])
def test_bad_options(nothing_starts, options, match):
    with pytest.raises(ValueError, match=match):
        nbddp.launch(print, 2, **options)


def test_bad_env(nothing_starts):
    with pytest.raises(TypeError, match="env must map str to str"):
        nbddp.launch(print, 2, env={"SEED": 1})


def test_fn_not_callable(nothing_starts):
    with pytest.raises(TypeError, match="fn must be callable"):
        nbddp.launch("train", 2)


def test_an_unpicklable_argument_is_named(nothing_starts):
    with pytest.raises(nbddp.PayloadError, match=r"cannot send args\[1\].*_thread.lock"):
        nbddp.launch(print, 2, args=(1, threading.Lock()))
    with pytest.raises(nbddp.PayloadError, match=r"cannot send kwargs\['lock'\]"):
        nbddp.launch(print, 2, kwargs={"lock": threading.Lock()})


def test_an_unpicklable_captured_object_is_named(nothing_starts):
    lock = threading.Lock()

    def train():
        with lock:
            pass

    with pytest.raises(nbddp.PayloadError, match=r"cannot send 'lock' \(captured by train\)"):
        nbddp.launch(train, 2)


LOCK = threading.Lock()


def uses_a_global_lock():
    with LOCK:
        pass


def test_an_unpicklable_global_is_named(nothing_starts):
    # A module-level function pickles by reference; a notebook's (in __main__) by
    # value, which is what brings its globals along. Simulate the notebook.
    uses_a_global_lock.__module__ = "__main__"
    try:
        with pytest.raises(nbddp.PayloadError,
                           match=r"global 'LOCK' \(used by uses_a_global_lock\)"):
            nbddp.launch(uses_a_global_lock, 2)
    finally:
        uses_a_global_lock.__module__ = __name__


def test_payloads_that_are_not_functions_are_rejected_before_start(nothing_starts):
    with pytest.raises(nbddp.PayloadError):
        nbddp.launch(print, 2, args=((x for x in range(3)),))


def test_a_large_payload_warns_naming_the_largest_captured_objects(monkeypatch):
    monkeypatch.setattr(_payload, "LARGE_PAYLOAD_BYTES", 1_000_000)
    dataset = bytes(3_000_000)

    def train():
        return len(dataset)

    with pytest.warns(UserWarning, match=r"largest parts: 'dataset' \(captured by train\)"):
        assert nbddp.launch(train, 2, init=False) == 3_000_000


def test_a_real_100mb_payload_still_works_and_warns():
    blob = bytes(105 * 2**20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert nbddp.launch(len, 2, args=(blob,), init=False) == len(blob)
    assert any("args[0]" in str(w.message) for w in caught)


def test_cpu_default_is_two_ranks(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert RunOptions().on_this_machine().nprocs == CPU_DEFAULT_NPROCS == 2
