"""The channel's handshake: each end of a new connection proves it holds the run's key.

The run's random key (a 0600 file) is the only secret, and a peer must prove it holds the
key before anything it sends is unpickled. The handshake keeps the order of
``multiprocessing.connection``'s ``deliver_challenge``/``answer_challenge``, with
HMAC-SHA256: the kernel proves nothing until the rank has proved itself, so a stranger
cannot use the kernel to answer the kernel's own challenge::

    kernel -> rank    MAGIC, kernel nonce
    rank -> kernel    rank nonce, HMAC(key, "rank" | kernel nonce | rank nonce)
    kernel            checks it; a wrong answer closes the connection, nothing more is said
    kernel -> rank    HMAC(key, "kernel" | kernel nonce | rank nonce)
    rank              checks it

Both nonces are fresh on every connection, so a recorded handshake cannot be replayed.
Both nonces also make the connection's frame keys, one per direction, with which the
link seals every frame after it (``_wire.sealed_link``).
"""

from __future__ import annotations

import hmac
import secrets
import socket

from .sealed_link import MAC_BYTES, SealedLink, recv_exact, seal

KEY_BYTES = 32
NONCE_BYTES = 32
MAGIC = b"nbddp-channel/2\n"
"""The kernel's first bytes: a rank connected to something else fails at once."""
HANDSHAKE_TIMEOUT = 10.0


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def _mac(key: bytes, label: bytes, *parts: bytes | memoryview) -> bytes:
    return seal(key, label, *parts)


def _keys(key: bytes, kernel_nonce: bytes, rank_nonce: bytes) -> tuple[bytes, bytes]:
    """This connection's frame keys: (rank to kernel, kernel to rank)."""
    return (_mac(key, b"rank->kernel", kernel_nonce, rank_nonce),
            _mac(key, b"kernel->rank", kernel_nonce, rank_nonce))


def challenge_rank(sock: socket.socket, key: bytes) -> SealedLink:
    """The kernel's half of the handshake: check the rank's proof, then give its own."""
    kernel_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + kernel_nonce)
    reply = recv_exact(sock, NONCE_BYTES + MAC_BYTES)
    rank_nonce, proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(key, b"rank", kernel_nonce, rank_nonce)):
        raise ConnectionError("peer does not hold the run's key")
    sock.sendall(_mac(key, b"kernel", kernel_nonce, rank_nonce))
    from_rank, to_rank = _keys(key, kernel_nonce, rank_nonce)
    return SealedLink(sock, send_key=to_rank, receive_key=from_rank)


def answer_kernel(sock: socket.socket, key: bytes) -> SealedLink:
    """A rank's half of the handshake: prove it holds the key, then check the kernel."""
    hello = recv_exact(sock, len(MAGIC) + NONCE_BYTES)
    if not hello.startswith(MAGIC):
        raise ConnectionError("the address does not lead to an nbddp kernel")
    kernel_nonce = hello[len(MAGIC):]
    rank_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(rank_nonce + _mac(key, b"rank", kernel_nonce, rank_nonce))
    try:
        proof = recv_exact(sock, MAC_BYTES)
    except ConnectionError as exc:
        raise ConnectionError("the kernel refused this rank's proof: its key is not the "
                              "run's key") from exc
    if not hmac.compare_digest(proof, _mac(key, b"kernel", kernel_nonce, rank_nonce)):
        raise ConnectionError("the kernel's end does not hold the run's key")
    from_rank, to_rank = _keys(key, kernel_nonce, rank_nonce)
    return SealedLink(sock, send_key=from_rank, receive_key=to_rank)
