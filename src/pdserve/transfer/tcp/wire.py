"""Frame I/O on one TCP transport connection after its handshake: plain, or sealed with
AES-256-GCM (`TcpOptions.encrypt`).

Sealed records. Every part a sender hands to `send` (the 32-byte header, the block-id list, each
block, a control message) goes out as one record: its ciphertext then a 16-byte GCM tag. The
receiver knows each record's plaintext length before it reads it (from the header, itself a
record of fixed size), so records need no length prefix. Nonce of record k on a connection:
4 zero bytes || k as u64 LE, counted from 0 by both ends; with the per-connection key below a
nonce is never reused. A record dropped, reordered, replayed, cut or altered fails its tag;
that raises `ProtocolError`, which ends the connection and marks the peer dead.

Key of a connection: HMAC-SHA256(secret, domain || len-prefixed HELLO envelope || len-prefixed
HELLO_ACK envelope) (`HandshakeAuth.session_key`). Each envelope carries a random nonce from
its sender, so every connection has a fresh key known only to holders of the shared secret.

Zero copy where the cipher allows: block bytes are encrypted with `encrypt_into` from the pool
into one reused scratch buffer and sent from there; incoming block records are received into
a scratch buffer and decrypted with `decrypt_into` straight into the pool. A block whose tag
fails may hold garbage, but its move never completes (the connection dies first), so the
session layer never marks it filled.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pdserve.transfer.tcp.frames import (
    HEADER,
    Frame,
    ProtocolError,
    drain,
    parse_header,
    recv_exact,
    recv_into_all,
    send_all,
)

TAG_BYTES = 16
SMALL_RECORD = 1 << 16  # records below this are sealed into new bytes and sent in one batch
MAX_RECORD = 1 << 30
_NONCE = struct.Struct("<4xQ")

Buffer = bytes | bytearray | memoryview


class Wire:
    """Frames over one connected socket; `key` None sends and expects plaintext.

    One thread sends on a wire, one thread receives on it (the transport's sender and reader
    threads); a wire keeps per-direction state (record counter, scratch), so neither side may be
    shared between threads.
    """

    def __init__(self, sock: socket.socket, key: bytes | None = None) -> None:
        self.sock = sock
        self._aead = AESGCM(key) if key is not None else None
        self._count = 0
        self._scratch = bytearray()

    @property
    def sealed(self) -> bool:
        return self._aead is not None

    def send(self, parts: Sequence[Buffer]) -> None:
        """Send one frame: `parts` in order (the header first), each one record if sealed."""
        if self._aead is None:
            send_all(self.sock, parts)
            return
        batch: list[Buffer] = []
        for part in parts:
            view = memoryview(part).cast("B")
            if len(view) < SMALL_RECORD:
                batch.append(self._aead.encrypt(self._nonce(), view, None))
                continue
            out = self._scratch_view(len(view) + TAG_BYTES)
            self._aead.encrypt_into(self._nonce(), view, None, out)
            send_all(self.sock, [*batch, out])
            batch = []
        if batch:
            send_all(self.sock, batch)

    def recv_header(self) -> tuple[Frame, int, int, int, int]:
        """(type, count, transfer id, move id, payload length); EOF at a frame boundary raises
        EOFError."""
        size = HEADER.size + (TAG_BYTES if self._aead is not None else 0)
        first = self.sock.recv(size, socket.MSG_WAITALL)
        if not first:
            raise EOFError("peer closed the connection")
        raw = first + recv_exact(self.sock, size - len(first))
        return parse_header(self._open(raw) if self._aead is not None else raw)

    def recv_exact(self, n: int) -> bytes:
        """One record of n plaintext bytes."""
        if self._aead is None:
            return recv_exact(self.sock, n)
        return self._open(recv_exact(self.sock, n + TAG_BYTES))

    def recv_into(self, view: memoryview) -> None:
        """One record of len(view) plaintext bytes, landed in `view`."""
        if self._aead is None:
            recv_into_all(self.sock, view)
            return
        sealed = self._scratch_view(len(view) + TAG_BYTES)
        recv_into_all(self.sock, sealed)
        try:
            self._aead.decrypt_into(self._nonce(), sealed, None, view)
        except InvalidTag:
            raise self._tampered() from None

    def skip(self, sizes: Sequence[int]) -> None:
        """Read and discard records of these plaintext sizes (a refused or cancelled frame)."""
        if self._aead is None:
            drain(self.sock, sum(sizes))
            return
        for n in sizes:
            if n > MAX_RECORD:
                raise ProtocolError(f"record of {n} bytes exceeds {MAX_RECORD}")
            self.recv_into(memoryview(bytearray(n)))

    # -- sealing -------------------------------------------------------------------------------

    def _nonce(self) -> bytes:
        nonce = _NONCE.pack(self._count)
        self._count += 1
        return nonce

    def _open(self, sealed: bytes) -> bytes:
        assert self._aead is not None
        try:
            return self._aead.decrypt(self._nonce(), sealed, None)
        except InvalidTag:
            raise self._tampered() from None

    @staticmethod
    def _tampered() -> ProtocolError:
        return ProtocolError("a sealed record failed authentication (altered, reordered or cut "
                             "in transit, or the peers hold different secrets)")

    def _scratch_view(self, n: int) -> memoryview:
        if len(self._scratch) < n:
            self._scratch = bytearray(n)
        return memoryview(self._scratch)[:n]
