"""HMAC-SHA256 authentication of transfer handshakes with a shared secret.

A signed handshake is an envelope around the message (an encoded descriptor, say):

    offset 0   4 bytes   magic b"PDA1"
           4   u64 LE    sender's wall-clock time, milliseconds since the Unix epoch
          12   16 bytes  random nonce
          28   32 bytes  HMAC-SHA256(secret, domain || bytes 0..28 || message)
          60   ...       message

The receiver refuses an envelope whose MAC does not match (wrong or missing secret), whose
time is more than `window_s` away from its own clock (an old handshake replayed, or clocks
apart), or whose nonce it already accepted within the window (an exact replay). Refusals
raise `PeerRefused`; callers log its message and drop the peer. MACs compare in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Callable

MIN_SECRET_BYTES = 16
DEFAULT_WINDOW_S = 30.0
DEFAULT_MAX_NONCES = 100_000

_MAGIC = b"PDA1"
_DOMAIN = b"pdserve/transfer-handshake/v1\x00"
_KEY_DOMAIN = b"pdserve/transfer-session-key/v1\x00"
_PREFIX = struct.Struct("<4sQ16s")
_MAC_BYTES = 32
ENVELOPE_OVERHEAD = _PREFIX.size + _MAC_BYTES


class PeerRefused(ValueError):
    """A peer's handshake failed authentication. The message starts with "peer refused"."""

    def __init__(self, why: str) -> None:
        super().__init__(f"peer refused: {why}")


def _check_secret(secret: bytes) -> None:
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the transfer secret must be at least {MIN_SECRET_BYTES} bytes shared by every "
            "worker (e.g. secrets.token_bytes(32)); configure the same one on both peers"
        )


def _mac(secret: bytes, signed_part: bytes | memoryview, message: bytes | memoryview) -> bytes:
    h = hmac.new(secret, _DOMAIN, hashlib.sha256)
    h.update(signed_part)
    h.update(message)
    return h.digest()


def sign(secret: bytes, message: bytes, now: float | None = None) -> bytes:
    """Wrap `message` in an envelope authenticated with `secret`, stamped `now` (default: now)."""
    _check_secret(secret)
    stamp = round((time.time() if now is None else now) * 1000)
    prefix = _PREFIX.pack(_MAGIC, stamp, secrets.token_bytes(16))
    return prefix + _mac(secret, prefix, message) + message


def open_envelope(
    secret: bytes,
    envelope: bytes | bytearray | memoryview,
    window_s: float = DEFAULT_WINDOW_S,
    now: float | None = None,
) -> tuple[bytes, bytes, float]:
    """Check MAC and freshness; return (message, nonce, sender time in seconds).

    Stateless: it does not catch an exact replay inside the window (`HandshakeAuth` does).
    Raises PeerRefused for an unsigned, forged, wrongly keyed or stale envelope.
    """
    _check_secret(secret)
    if not isinstance(envelope, bytes | bytearray | memoryview):
        raise PeerRefused(f"handshake is not signed (got {type(envelope).__name__})")
    view = memoryview(envelope).cast("B")
    if len(view) < ENVELOPE_OVERHEAD:
        raise PeerRefused("handshake is not signed (no or truncated authentication envelope)")
    magic, stamp, nonce = _PREFIX.unpack_from(view)
    if magic != _MAGIC:
        raise PeerRefused("handshake is not signed (unknown envelope magic)")
    mac = view[_PREFIX.size : ENVELOPE_OVERHEAD]
    message = view[ENVELOPE_OVERHEAD:]
    if not hmac.compare_digest(mac, _mac(secret, view[: _PREFIX.size], message)):
        raise PeerRefused("handshake signature does not match (wrong or missing shared secret)")
    sent = stamp / 1000
    age = (time.time() if now is None else now) - sent
    if abs(age) > window_s:
        raise PeerRefused(f"handshake is {age:+.1f} s old, outside the {window_s} s window "
                          "(a replay, or the peers' clocks disagree)")
    return bytes(message), nonce, sent


class HandshakeAuth:
    """Signs outgoing handshakes and verifies incoming ones, remembering accepted nonces.

    Invariant: a nonce is accepted at most once while its envelope is inside the window; it is
    forgotten after its time has left the window (then the freshness check refuses it anyway),
    in arrival order, so an entry may outlive its window by up to one more window.
    When `max_nonces` unexpired nonces are held, new handshakes are refused rather than an
    unexpired nonce forgotten. Lifetime: one per worker process. Not thread-safe.
    """

    def __init__(
        self,
        secret: bytes,
        window_s: float = DEFAULT_WINDOW_S,
        max_nonces: int = DEFAULT_MAX_NONCES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        _check_secret(secret)
        if window_s <= 0 or max_nonces <= 0:
            raise ValueError(f"window_s ({window_s}) and max_nonces ({max_nonces}) must be > 0")
        self._secret = secret
        self.window_s = window_s
        self.max_nonces = max_nonces
        self._clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> forget after

    @property
    def num_nonces(self) -> int:
        """Accepted nonces still remembered."""
        return len(self._seen)

    def sign(self, message: bytes) -> bytes:
        return sign(self._secret, message, self._clock())

    def session_key(self, *transcript: bytes) -> bytes:
        """A 32-byte key bound to the secret and this handshake transcript:
        HMAC-SHA256(secret, key domain || for each part: u32 LE length || part). Fresh when any
        part carries a fresh nonce (both TCP handshake envelopes do)."""
        h = hmac.new(self._secret, _KEY_DOMAIN, hashlib.sha256)
        for part in transcript:
            h.update(struct.pack("<I", len(part)))
            h.update(part)
        return h.digest()

    def verify(self, envelope: bytes | bytearray | memoryview) -> bytes:
        """The authenticated message; raises PeerRefused if forged, stale or replayed."""
        now = self._clock()
        message, nonce, sent = open_envelope(self._secret, envelope, self.window_s, now)
        self._forget_expired(now)
        if nonce in self._seen:
            raise PeerRefused("handshake replayed (nonce already accepted)")
        if len(self._seen) >= self.max_nonces:
            raise PeerRefused(f"too many handshakes within {self.window_s} s "
                              f"({self.max_nonces} held); retry later")
        self._seen[nonce] = sent + self.window_s
        return message

    def _forget_expired(self, now: float) -> None:
        while self._seen:
            nonce, forget_after = next(iter(self._seen.items()))
            if forget_after >= now:
                return
            del self._seen[nonce]

    def __repr__(self) -> str:  # never show the secret
        return f"HandshakeAuth(window_s={self.window_s}, nonces={self.num_nonces})"
