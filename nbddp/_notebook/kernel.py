"""Is this process a notebook's kernel (not a rank, a script, or a plain Python)?"""

from __future__ import annotations

import sys


def in_notebook_kernel() -> bool:
    """True where the shell is ipykernel's (or a subclass: Colab, VS Code). Looked up,
    never imported: a kernel's process has loaded both already."""
    zmqshell, ipython = sys.modules.get("ipykernel.zmqshell"), sys.modules.get("IPython")
    if zmqshell is None or ipython is None:
        return False
    return isinstance(ipython.get_ipython(), zmqshell.ZMQInteractiveShell)
