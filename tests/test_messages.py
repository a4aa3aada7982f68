"""Frames: the one encoding of what crosses between kernel and ranks (pure logic)."""

from __future__ import annotations

import pytest

from nbddp._wire.frames import decode, encode, split_frames
from nbddp._wire.messages import Failure, Hello, RankOptions, Sequenced, Start

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast


def test_messages_survive_a_frame():
    start = Start("0.2.0", "/records", "/run/payload.pkl", RankOptions(backend="gloo"),
                  cwd="/data", env={"A": "1", "B": None})
    for message in (start, Sequenced(3, Hello(1, 42)),
                    Failure(0, "ValueError", "builtins", "bad", "Traceback...")):
        bodies, used = split_frames(encode(message))
        assert used == len(encode(message))
        assert decode(bodies[0]) == message


def test_partial_frames_wait_for_the_rest():
    data = encode(Hello(0, 1)) + encode(Hello(1, 2))
    for cut in range(len(data)):
        bodies, used = split_frames(data[:cut])
        assert [decode(b) for b in bodies] == [Hello(0, 1), Hello(1, 2)][:len(bodies)]
        assert used <= cut
        rest, _ = split_frames(data[used:])
        assert [decode(b) for b in bodies + rest] == [Hello(0, 1), Hello(1, 2)]
