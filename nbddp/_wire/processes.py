"""The processes a process started, at any depth, read from ``/proc``.

Linux lists a process's children only per thread (``/proc/PID/task/TID/children``, and
only where the kernel was built with it), so each process's parent is read from its
``stat`` instead. Used by the kernel (who maps a memory file) and by a rank (which of
its own processes would use torchrun's agent store).
"""

from __future__ import annotations

import os


def descendants(root: int) -> list[int]:
    """The processes ``root`` started, and theirs, from each process's parent in
    ``/proc`` (the kernel may not list children itself)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                parent = int(stat.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found
