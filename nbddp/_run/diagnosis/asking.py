"""Asking every rank one question over the channel and gathering the answers.

The kernel asks a running rank things it can only answer from inside: its stacks (on
another machine, where no signal reaches it), where it is in its collectives. Each
question is numbered; an answer to an earlier one does not count, and a rank that does
not answer in time is left out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol, cast


class Answer(Protocol):
    rank: int
    call: int


class Question:
    """One kind of question (``ask``), and the channel's thread handing in its answers
    (``took``)."""

    def __init__(self, answer_type: type) -> None:
        self._answer_type = answer_type
        self._came = threading.Condition()
        self._call = 0
        self._answers: dict[int, Any] = {}
        self._asking = threading.Lock()  # one ask at a time: each waits for its own answers

    def ask(self, ranks: Iterable[int], send: Callable[[int, int], bool],
            wait: float) -> dict[int, Any]:
        """``send(rank, call)`` to each rank (False: it cannot be reached), then the
        answers that came within ``wait`` seconds, by rank."""
        with self._asking:
            with self._came:
                self._call += 1
                call, self._answers = self._call, {}
            asked = {rank for rank in ranks if send(rank, call)}
            with self._came:
                self._came.wait_for(lambda: asked <= set(self._answers), wait)
                return dict(sorted(self._answers.items()))

    def took(self, message: Any) -> bool:
        """True if ``message`` answers this kind of question (kept if it answers the
        latest one)."""
        if not isinstance(message, self._answer_type):
            return False
        answer = cast(Answer, message)
        with self._came:
            if answer.call == self._call:
                self._answers[answer.rank] = answer
                self._came.notify_all()
        return True
