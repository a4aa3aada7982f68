"""How a message is framed: an 8-byte length, then the pickled message.

The channel's sockets and the start file carry these frames; a mailbox file marks and
checksums each message instead, around its ``pickled`` bytes (``_wire.mailbox``). One
module frames for every carrier, so that all of them frame alike. ``decode`` unpickles:
frames are only decoded from authenticated peers or from private (0600) files.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

_HEADER = struct.Struct("!Q")  # any length
HEADER_SIZE = _HEADER.size


def encode(message: Any) -> bytes:
    """One frame: the length, then the pickled message."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def body_size(header: bytes) -> int:
    """The length a frame's header announces."""
    return _HEADER.unpack(header)[0]


def decode(body: bytes | memoryview) -> Any:
    """The message in a frame's body."""
    return pickle.loads(body)


def split_frames(data: bytes) -> tuple[list[bytes], int]:
    """The bodies of the complete frames at the start of ``data``, and the bytes they use."""
    bodies, used = [], 0
    while len(data) - used >= HEADER_SIZE:
        end = used + HEADER_SIZE + body_size(data[used:used + HEADER_SIZE])
        if end > len(data):
            break  # the rest of this frame is still being written
        bodies.append(data[used + HEADER_SIZE:end])
        used = end
    return bodies, used


def pickled(message: Any) -> bytes:
    """A message's bytes without a frame's length: what a mailbox frame carries, behind
    a marker and a checksum of its own (``_wire.mailbox``)."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
