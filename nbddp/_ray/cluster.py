"""The kernel's connection to a Ray cluster: made once, never a cluster of its own.

``import nbddp`` never imports ray: this module does, when a Ray run or session starts.
``ray.init()`` with no cluster would start one inside the kernel; nbddp asks for a
running cluster instead (``RAY_ADDRESS``, or the one started on this machine by ``ray
start``), and says how to start one when there is none. Wherever the address comes from
(the one ``ray start`` left in Ray's temp folder too, which outlives a cluster killed
without ``ray stop``), nbddp first checks that something answers there: ``ray.init``
would retry a dead address for minutes. A kernel already connected
(the user's own ``ray.init``) is used as it is. ``ray.init`` points ``breakpoint()``
at Ray's debugger (``PYTHONBREAKPOINT``): nbddp puts the notebook's own setting back,
so that every rank's ``breakpoint()`` still opens in the notebook.
"""

from __future__ import annotations

import os
import socket
from types import ModuleType

from .._errors import NbddpError

_PROBE_WAIT = 5.0  # seconds for a cluster's GCS to accept a connection

NAMESPACE = "nbddp"
"""The Ray namespace of every session's placement group and agents (named there, so a
kernel that attaches finds them; a namespace is no security boundary, see the docs)."""


def ray_module() -> ModuleType:
    """``ray``, imported now; a clear error where it is not installed."""
    try:
        import ray
    except ImportError:
        raise NbddpError("ray is not installed in this kernel's environment: "
                         "pip install 'nbddp[ray]'") from None
    return ray


def connect(address: str | None) -> ModuleType:
    """``ray``, connected to the cluster at ``address`` (None: ``RAY_ADDRESS``, then the
    cluster running on this machine)."""
    ray = ray_module()
    if ray.is_initialized():
        return ray
    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    if target.startswith("ray://"):
        raise NbddpError(f"RAY_ADDRESS={target} is a Ray Client address: nbddp needs the "
                         "kernel inside the cluster (give the GCS address, host:port)")
    found_as = ""
    if target == "auto":
        target, found_as = _auto_address(), _LEFT_BY_RAY_START
    _check_answers(target, found_as)
    breakpoint_hook = os.environ.get("PYTHONBREAKPOINT")
    try:
        ray.init(address=target, namespace=NAMESPACE, log_to_driver=False,
                 logging_level="WARNING", configure_logging=False)
    except ConnectionError as exc:
        raise _unreachable(target, str(exc)) from None
    finally:  # (ray.init points breakpoint() at Ray's debugger: the notebook's is kept)
        _restore("PYTHONBREAKPOINT", breakpoint_hook)
    return ray


def _auto_address() -> str:
    """The cluster ``"auto"`` names for Ray: one running on this machine, else the last
    ``ray start``'s address (still ``"auto"`` where Ray finds neither: its ``ray.init``
    then says so at once)."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address("auto") or "auto"
    except Exception:  # noqa: BLE001 - nothing found, or Ray's lookup moved: ray.init looks
        return "auto"


_LEFT_BY_RAY_START = ("; that address is the last `ray start`'s on this machine: was its "
                      "cluster stopped without `ray stop`?")


def _check_answers(target: str, found_as: str = "") -> None:
    """An address given as ``HOST:PORT`` where nothing answers raises at once: ``ray.init``
    would wait minutes for it, retrying (``found_as``: where it came from, said after)."""
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return  # ("auto": Ray looks for a cluster on this machine itself, at once)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_WAIT).close()
    except OSError as exc:
        raise _unreachable(target, f"nothing answers there: {exc.strerror or exc}"
                                   f"{found_as}") from None


def _unreachable(target: str, why: str) -> NbddpError:
    return NbddpError(
        f"no Ray cluster reachable at {target!r} ({why}); start one (`ray start --head` "
        "on this machine, or run the notebook on a cluster's head node) or give its "
        "address: nbddp.Ray(address='HOST:6379')")


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def kernel_address(ray: ModuleType) -> str:
    """The address the cluster's nodes reach this kernel at: its node's, as Ray sees it
    (``NBDDP_KERNEL_HOST`` overrides)."""
    return os.environ.get("NBDDP_KERNEL_HOST") or ray.util.get_node_ip_address()
