"""A Ray session's ``runtime_env``, made usable by its agents.

Ray takes a local ``working_dir`` or ``py_modules`` folder only at a job's level
(``ray.init(runtime_env=...)``), where it uploads them to the cluster and names them by
URI; an actor's ``runtime_env`` must name them by URI already. A session's agents are
actors of the kernel's Ray job, and each session may have an environment of its own, so
the kernel uploads the local folders itself, in the same way as ``ray.init`` (Ray's own
upload: content-hashed packages in the cluster's store, ``.gitignore`` respected), and
hands the agents the URIs. Everything else (``pip``, ``env_vars``, URIs given) goes to Ray
as it is.
"""

from __future__ import annotations

import inspect
import logging
from types import ModuleType
from typing import Any

from .._errors import NbddpError

logger = logging.getLogger(__name__)


def for_actors(ray: ModuleType, runtime_env: dict[str, Any]) -> dict[str, Any]:
    """``runtime_env`` with its local ``working_dir`` and ``py_modules`` uploaded to the
    cluster ``ray`` is connected to, and named by their URIs."""
    if "working_dir" not in runtime_env and "py_modules" not in runtime_env:
        return runtime_env
    try:  # (Ray's own upload, as ray.init uses it: not a public API of Ray's)
        from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
        from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

        scratch = ray._private.worker.global_worker.node.get_runtime_env_dir_path()
    except (ImportError, AttributeError) as exc:
        raise NbddpError(
            f"this Ray ({ray.__version__}) does not upload a local working_dir or "
            f"py_modules as nbddp expects ({type(exc).__name__}: {exc}): pass them as "
            "URIs (e.g. an s3:// or gs:// zip), or use Ray 2.60") from None
    env = dict(runtime_env)
    for upload in (upload_py_modules_if_needed, upload_working_dir_if_needed):
        options: dict[str, Any] = {"scratch_dir": scratch, "logger": logger}
        if "include_gitignore" in inspect.signature(upload).parameters:
            options["include_gitignore"] = True  # (Ray 2.48 and later ask)
        env = upload(env, **options)
    env.pop("excludes", None)  # (what the upload left out: done with)
    return env
