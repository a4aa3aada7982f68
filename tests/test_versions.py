"""The versions a kernel and its ranks on other machines compare (``_wire.versions``);
the real check, a Ray node with another torch, is in ``test_ray_code``."""

from __future__ import annotations

import sys

import pytest

from nbddp import __version__
from nbddp._wire.versions import own_versions, skew

pytestmark = pytest.mark.fast

KERNEL = (("Python", "3.11"), ("torch", "2.13.0"), ("cloudpickle", "3.1.1"), ("nbddp", "0.2.0"))


def test_a_process_says_its_python_torch_cloudpickle_and_nbddp():
    versions = dict(own_versions())
    assert versions["Python"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert versions["nbddp"] == __version__
    assert "+" not in versions["torch"]  # (a CPU build and a CUDA build are one torch)
    import cloudpickle

    assert versions["cloudpickle"] == cloudpickle.__version__


def test_the_same_versions_are_no_skew():
    assert skew("node-a", KERNEL, KERNEL) is None


def test_each_difference_is_named_with_both_versions_and_what_to_do():
    theirs = (("Python", "3.10"), ("torch", "2.13.0"), ("cloudpickle", "2.2.1"),
              ("nbddp", "0.2.0"))
    said = skew("node-b", theirs, KERNEL)
    assert said is not None
    assert said.startswith("node node-b runs Python 3.10 (the notebook's kernel has 3.11), "
                           "cloudpickle 2.2.1 (the notebook's kernel has 3.1.1): ")
    assert "torch" not in said.split(":")[0]
    assert "one image" in said
