"""Handshake authentication: HMAC-SHA256 envelopes, freshness window, replay refusal."""

from __future__ import annotations

import struct

import pytest

from pdserve.transfer.auth import (
    ENVELOPE_OVERHEAD,
    HandshakeAuth,
    PeerRefused,
    open_envelope,
    sign,
)

SECRET = b"s" * 32
OTHER = b"t" * 32
MESSAGE = b"PDTX descriptor bytes"


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _auth(clock: Clock, **kwargs) -> HandshakeAuth:
    return HandshakeAuth(SECRET, clock=clock, **kwargs)


def test_round_trip():
    envelope = sign(SECRET, MESSAGE)
    assert len(envelope) == len(MESSAGE) + ENVELOPE_OVERHEAD and envelope.endswith(MESSAGE)
    message, nonce, _ = open_envelope(SECRET, envelope)
    assert message == MESSAGE and len(nonce) == 16
    assert open_envelope(SECRET, bytearray(envelope))[0] == MESSAGE
    assert sign(SECRET, MESSAGE) != envelope  # a fresh nonce every time


def test_wrong_secret_refuses_the_peer():
    with pytest.raises(PeerRefused, match=r"^peer refused: .*wrong or missing shared secret"):
        open_envelope(OTHER, sign(SECRET, MESSAGE))
    assert issubclass(PeerRefused, ValueError)


@pytest.mark.parametrize("envelope", [MESSAGE, b"", b"PDA1" + bytes(20), "text", None])
def test_unsigned_handshakes_are_refused(envelope):
    with pytest.raises(PeerRefused, match=r"^peer refused: handshake is not signed"):
        open_envelope(SECRET, envelope)


def test_every_tampered_byte_is_refused():
    envelope = sign(SECRET, MESSAGE)
    for i in range(len(envelope)):
        bad = bytearray(envelope)
        bad[i] ^= 0x01
        with pytest.raises(PeerRefused):
            open_envelope(SECRET, bytes(bad))
    with pytest.raises(PeerRefused):
        open_envelope(SECRET, envelope + b"x")
    with pytest.raises(PeerRefused):
        open_envelope(SECRET, envelope[:-1])


def test_freshness_window():
    t = 1_800_000_000.0
    envelope = sign(SECRET, MESSAGE, now=t)
    assert open_envelope(SECRET, envelope, window_s=30, now=t + 29.9)[0] == MESSAGE
    assert open_envelope(SECRET, envelope, window_s=30, now=t - 29.9)[0] == MESSAGE
    for now in (t + 30.5, t - 30.5, t + 3600):
        with pytest.raises(PeerRefused, match="outside the 30 s window"):
            open_envelope(SECRET, envelope, window_s=30, now=now)


def test_restamping_an_old_handshake_breaks_the_mac():
    t = 1_800_000_000.0
    envelope = sign(SECRET, MESSAGE, now=t)
    restamped = envelope[:4] + struct.pack("<Q", round((t + 100) * 1000)) + envelope[12:]
    with pytest.raises(PeerRefused, match="signature"):
        open_envelope(SECRET, restamped, now=t + 100)


def test_replays_are_refused_and_nonces_forgotten_after_the_window():
    clock = Clock()
    sender, receiver = _auth(clock), _auth(clock, window_s=10)
    envelope = sender.sign(MESSAGE)
    assert receiver.verify(envelope) == MESSAGE
    with pytest.raises(PeerRefused, match="replayed"):
        receiver.verify(envelope)
    clock.t += 5
    assert receiver.verify(sender.sign(b"second")) == b"second" and receiver.num_nonces == 2
    clock.t += 6  # the first envelope has left the window: forgotten, and refused as stale
    with pytest.raises(PeerRefused, match="window"):
        receiver.verify(envelope)
    assert receiver.verify(sender.sign(b"third")) == b"third" and receiver.num_nonces == 2
    clock.t += 30
    receiver.verify(sender.sign(b"fourth"))
    assert receiver.num_nonces == 1


def test_a_full_nonce_cache_refuses_rather_than_forgets():
    clock = Clock()
    auth = _auth(clock, max_nonces=2)
    auth.verify(auth.sign(b"1"))
    auth.verify(auth.sign(b"2"))
    with pytest.raises(PeerRefused, match="too many handshakes"):
        auth.verify(auth.sign(b"3"))
    clock.t += 31
    assert auth.verify(auth.sign(b"3")) == b"3"


def test_a_refused_handshake_is_not_remembered():
    clock = Clock()
    auth = _auth(clock)
    with pytest.raises(PeerRefused):
        auth.verify(sign(OTHER, MESSAGE, now=clock.t))
    assert auth.num_nonces == 0


@pytest.mark.parametrize("secret", [b"", b"short", "a string secret of enough length", None])
def test_a_missing_or_weak_local_secret_is_a_configuration_error(secret):
    with pytest.raises(ValueError, match="at least 16 bytes") as info:
        HandshakeAuth(secret)
    assert not isinstance(info.value, PeerRefused)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        sign(secret, MESSAGE)


def test_settings_are_validated_and_the_secret_never_shown():
    with pytest.raises(ValueError, match="window_s"):
        HandshakeAuth(SECRET, window_s=0)
    with pytest.raises(ValueError, match="max_nonces"):
        HandshakeAuth(SECRET, max_nonces=0)
    assert "sss" not in repr(HandshakeAuth(SECRET))
