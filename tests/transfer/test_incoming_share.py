"""The tcp transport's host-wide share of an incoming link (`incoming_share.py`), on real
loopback connections and a clock of the test's own: the peers sending bulk data at once get
one equal window each, the budget split among them; one sender alone gets all of it; a
connection keeps its window while idle; a new one starts at the current window; no window is
under a few segments; the first update after a pause changes nothing."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from pdserve.transfer.tcp.incoming_share import (
    MIN_BYTES,
    SEGMENTS,
    STALE_S,
    UPDATE_S,
    IncomingShare,
    share_bytes,
)
from pdserve.transfer.tcp.tcp_info import tcp_info

# a budget well above the floor on loopback (256 KiB over STEP_S: ~8.7 MB/s x 0.5 s, ~4 MB
# against 4 segments of 64 KB), so the split shows in the windows
TARGET_S = 0.5
STEP_S = 1.5 * UPDATE_S  # past the next update, and not near the pause (STALE_S)


def _clamp(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP)


def _floor(sock: socket.socket) -> int:
    info = tcp_info(sock)
    assert info is not None
    return SEGMENTS * info.advmss


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """Two loopback connections: (sending end, accepted end)."""
    made = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        for _ in range(2):
            out = socket.create_connection(server.getsockname())
            accepted, _ = server.accept()
            made.append((out, accepted))
    yield made
    for out, accepted in made:
        out.close()
        accepted.close()


def _move(out: socket.socket, accepted: socket.socket, nbytes: int = 256 * 1024) -> None:
    """`nbytes` from one end to the other, all read."""
    sender = threading.Thread(target=out.sendall, args=(bytes(nbytes),))
    sender.start()
    left = nbytes
    while left:
        left -= len(accepted.recv(left))
    sender.join()


def _both_send(share: IncomingShare, pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    """A bulk frame reported on each connection, then bytes moved on it."""
    for out, accepted in pairs:
        share.arrived(accepted)
        _move(out, accepted)


def _both_sent(pairs: list[tuple[socket.socket, socket.socket]], target_s: float = TARGET_S
               ) -> tuple[Clock, IncomingShare, socket.socket, socket.socket]:
    """A share whose first update found both connections active (the accepted ends a1, a2)."""
    clock = Clock()
    share = IncomingShare(target_s, clock)
    a1, a2 = (accepted for _, accepted in pairs)
    _both_send(share, pairs)
    clock.now += STEP_S
    share.arrived(a1)  # the update: both were active since the last one
    return clock, share, a1, a2


def test_the_share_splits_the_budget_evenly_and_keeps_a_floor() -> None:
    assert share_bytes(1e9, 0.0005, 0.002, 2) == int(1e9 * 0.0025 / 2)
    assert share_bytes(1e9, 0.0005, 0.002, 4) == int(1e9 * 0.0025 / 4)
    assert share_bytes(1e6, 0.0001, 0.002, 8) == MIN_BYTES


def test_two_senders_at_once_get_one_equal_window_and_one_alone_gets_the_budget(
        pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    clock, share, a1, a2 = _both_sent(pairs)
    two = share.share
    assert two > max(_floor(a1), _floor(a2))
    assert _clamp(a1) == _clamp(a2) == two
    clock.now += STEP_S
    share.arrived(a1)  # only a1 since: the whole budget; a2 keeps its window while idle
    assert share.share > 1.5 * two  # about twice: one takes all
    assert (_clamp(a1), _clamp(a2)) == (share.share, two)


def test_no_window_is_under_a_few_of_its_segments(
        pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    """Under one segment the receiver would advertise a zero window and the sender wait for
    persist probes: a small budget gives each connection its floor instead."""
    _, share, a1, a2 = _both_sent(pairs, target_s=0.0005)
    assert share.share < _floor(a1)  # a budget of ~2 KB a connection
    assert _floor(a1) > MIN_BYTES  # loopback's segments: ~64 KB
    assert (_clamp(a1), _clamp(a2)) == (_floor(a1), _floor(a2))


def test_a_connection_that_joins_starts_at_the_current_window(
        pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    clock = Clock()
    share = IncomingShare(TARGET_S, clock)
    (o1, a1), (_, a2) = pairs
    share.arrived(a1)
    _move(o1, a1)
    clock.now += STEP_S
    share.arrived(a1)  # the update: a1 alone
    assert share.share > 0
    assert _clamp(a2) != share.share  # the kernel's
    share.joined(a2)  # its handshake done: before any bulk frame
    assert _clamp(a2) == share.share


def test_a_connection_that_joins_before_any_share_keeps_the_kernels_window(
        pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    share = IncomingShare(TARGET_S, Clock())
    (_, a1), _ = pairs
    own = _clamp(a1)
    share.joined(a1)
    assert share.share == 0 and _clamp(a1) == own


def test_the_first_update_after_a_pause_only_starts_a_new_measurement(
        pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    clock = Clock()
    share = IncomingShare(TARGET_S, clock)
    a1, a2 = (accepted for _, accepted in pairs)
    clock.now += 2 * STALE_S
    for out, accepted in pairs:
        _move(out, accepted)
        own = _clamp(accepted)
        share.arrived(accepted)
        assert share.share == 0 and _clamp(accepted) == own  # a pause: the rate is unknown
    for out, accepted in pairs:
        _move(out, accepted)
        share.arrived(accepted)
    clock.now += STEP_S
    share.arrived(a2)
    assert share.share > 0 and _clamp(a1) == _clamp(a2) == share.share


def test_a_forgotten_connection_no_longer_counts(
        pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    clock, share, a1, a2 = _both_sent(pairs)
    two = share.share
    share.arrived(a2)
    share.forget(a2)  # its connection ended after a last frame
    clock.now += STEP_S
    share.arrived(a1)
    assert share.share > 1.5 * two  # about twice: one takes all


def test_a_connection_closed_before_an_update_does_not_break_it(
        pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    clock = Clock()
    share = IncomingShare(TARGET_S, clock)
    a1, a2 = (accepted for _, accepted in pairs)
    _both_send(share, pairs)
    a2.close()  # its reader has not forgotten it yet
    clock.now += STEP_S
    share.arrived(a1)
    assert share.share > 0 and _clamp(a1) == share.share
