"""The versions a kernel and its ranks on other machines must share.

A payload is a pickle: the kernel's cloudpickle writes it and the rank's reads it, with
classes and functions by reference into torch and nbddp, and code objects built for the
kernel's Python. A node whose image differs fails somewhere inside unpickling, far from
the cause. So a rank on another machine says its versions in its hello, and the kernel
compares them with its own before any cell runs (``skew``): Python's major.minor, torch
and cloudpickle (their public versions: a CPU build of torch beside a CUDA one is the
same torch), and nbddp. Versions are read from the installed packages' metadata, so
saying them imports nothing (not torch).
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys

from .._version import __version__

Versions = tuple[tuple[str, str], ...]
"""Each package's name and version, in a fixed order."""

_PACKAGES = ("torch", "cloudpickle")

EVERY_NODE_NEEDS = ("the kernel and every node must run the same Python (major.minor), "
                    "torch, cloudpickle and nbddp, or what the notebook sends cannot be "
                    "read there")


@functools.cache
def own_versions() -> Versions:
    """This process's: Python (major.minor), torch, cloudpickle, nbddp."""
    found = [("Python", f"{sys.version_info.major}.{sys.version_info.minor}")]
    for name in _PACKAGES:
        try:
            found.append((name, importlib.metadata.version(name).partition("+")[0]))
        except importlib.metadata.PackageNotFoundError:
            found.append((name, "not installed"))
    found.append(("nbddp", __version__))
    return tuple(found)


def skew(node: str, theirs: Versions, ours: Versions | None = None) -> str | None:
    """What differs between ``node``'s versions and the kernel's (``ours``: this
    process's), said so that the user knows what to do; None if nothing does."""
    mine = dict(own_versions() if ours is None else ours)
    different = [f"{name} {version} (the notebook's kernel has {mine[name]})"
                 for name, version in theirs if name in mine and mine[name] != version]
    if not different:
        return None
    return (f"node {node} runs {', '.join(different)}: {EVERY_NODE_NEEDS}. Use one image "
            "(one environment) for the kernel and every node, e.g. the same container "
            "image for a Ray cluster's head and worker pods")
