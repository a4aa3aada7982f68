"""The threads that follow runs, kept waiting for the next run once theirs has ended.

Every run is followed by a thread of its own (``Job`` hands it the supervisor's loop), so
the caller may go on. Starting a thread waits until the new thread has been scheduled,
longer while a session's ranks hold this machine's cores, on every cell.
Handing the run to a thread that already waits costs one wake-up. Runs may overlap (a
``launch(wait=False)`` beside a session's cell), so a thread is started whenever none
waits; at most ``KEEP_WAITING`` stay once their runs have ended. They are daemon threads
(as the ones started per run were): a kernel that exits does not wait for them.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable

KEEP_WAITING = 2
NAME = "nbddp-supervisor"

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_waiting: list[queue.SimpleQueue[Callable[[], None]]] = []
"""The inbox of each thread that has no run to follow."""


def follow(task: Callable[[], None]) -> None:
    """Run ``task`` in a thread of its own: a waiting one, or a new one."""
    with _lock:
        inbox = _waiting.pop() if _waiting else None
    if inbox is None:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(inbox,), daemon=True, name=NAME).start()
    inbox.put(task)


def let_go(held: object) -> None:
    """Drop ``held`` (the caller keeps no reference of its own) in a follower thread:
    freeing what it holds (a run's result, a GiB of shared memory mapped, a fifth of a
    second to unmap) is not the caller's to wait for."""
    follow(functools.partial(_nothing, held))


def _nothing(held: object) -> None:
    """(The task that holds what ``let_go`` drops, until its thread deletes it.)"""


def _serve(inbox: queue.SimpleQueue[Callable[[], None]]) -> None:
    """Run each task put in ``inbox``; wait for the next unless enough threads wait."""
    while True:
        task = inbox.get()
        try:
            task()
        except BaseException:  # noqa: BLE001 - a run's loop reports its own; none ends us
            logger.exception("nbddp: the thread following a run failed")
        del task  # the ended run's job is not kept alive while this thread waits
        with _lock:
            if len(_waiting) >= KEEP_WAITING:
                return
            _waiting.append(inbox)
