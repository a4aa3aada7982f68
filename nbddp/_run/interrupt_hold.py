"""Ctrl-C held back while a run is handed to its ranks and its ``Job`` made, and while
processes are being stopped.

From the moment the first rank may get its Start until the caller waits in
``Job.result()`` (or has the ``Job``), an interrupt must stop the run: raised anywhere
in between (a wait inside ``threading.Thread.start``, a hand-over's lock), it would
leave the ranks running with no one following them, and a session busy with a run
that no cell owns. So the press is only noted there, and acted on once the ``Job``
exists: ``Job.result()`` stops the run as interrupted, as if the press had come a
moment later.

Only the main thread receives signals, and only while Python's own handler is the one
installed (a notebook cell, a script): elsewhere there is nothing to hold.

Every run takes and gives back a hold, so it uses the C module ``_signal`` that
``signal`` wraps: ``signal``'s functions turn each handler into an enum member, and for
a Python handler that conversion fails and is caught, a cost paid several times in
every quick cell's hand-over.
"""

from __future__ import annotations

import _signal
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TypeVar

T = TypeVar("T")


class InterruptHold:
    """While held, SIGINT is noted instead of raising ``KeyboardInterrupt``."""

    _current: InterruptHold | None = None
    """The hold in force on the main thread, if any (see ``pressed_now``)."""

    def __init__(self) -> None:
        self.pressed = False
        self._previous: object = None
        if (InterruptHold._current is None  # (inside another hold: nothing to hold)
                and threading.current_thread() is threading.main_thread()
                and _signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = _signal.signal(signal.SIGINT, self._note)
            InterruptHold._current = self

    @property
    def holding(self) -> bool:
        """Whether a press is noted now, not raised (False: nothing to hold here)."""
        return self._previous is not None

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.pressed = True

    def release(self) -> None:
        """Let Ctrl-C raise again; raise ``KeyboardInterrupt`` now if it was pressed
        while held. Once only: a second call does nothing."""
        pressed = self.pressed
        self.restore()
        if pressed:
            raise KeyboardInterrupt

    def restore(self) -> None:
        """Let Ctrl-C raise again, dropping a press (the start failed: its error is
        raised instead)."""
        self.pressed = False
        if self._previous is not None:
            _signal.signal(signal.SIGINT, self._previous)
            self._previous = None
            InterruptHold._current = None


def pressed_now() -> bool:
    """Ctrl-C was pressed while held, on the way to a run: a wait inside the hold (for
    ranks still starting) gives up, and the run that follows stops as interrupted."""
    hold = InterruptHold._current
    return hold is not None and hold.pressed


def held_while(start: Callable[[], T]) -> tuple[T, InterruptHold]:
    """``start()``, with Ctrl-C held from before it until the caller releases the hold
    it gets along (once what started is followed). If ``start`` raises, the hold is
    dropped and its error goes on."""
    hold = InterruptHold()
    try:
        return start(), hold
    except BaseException:
        hold.restore()
        raise


@contextlib.contextmanager
def interrupt_after() -> Iterator[None]:
    """Ctrl-C held back until the block is done, then raised: for stopping processes,
    which an interrupt must not leave half done (ranks sent SIGTERM and never SIGKILL,
    a session marked closed with its ranks still running). The block is bounded by its
    own timeouts."""
    hold = InterruptHold()
    try:
        yield
    except BaseException:
        hold.restore()
        raise
    hold.release()
