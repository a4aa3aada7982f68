"""Whether the notebook's own ``%autoreload`` is on: a session's ranks follow it."""

from __future__ import annotations

import sys


def notebook_autoreloads() -> bool:
    """Is IPython's autoreload on in this kernel, for every module (``%autoreload 2`` or
    3)? Looked up, never imported: a kernel that loaded the extension has it."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    magics = shell.magics_manager.registry.get("AutoreloadMagics") if shell else None
    reloader = getattr(magics, "_reloader", None)
    return bool(getattr(reloader, "enabled", False) and getattr(reloader, "check_all", False))
