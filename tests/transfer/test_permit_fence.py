"""The permits' fence: `revoke` waits for the frames that passed their check to end, and a
frame still moving past the wait has its connection shut down."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from pdserve.throttled_log import ThrottledLog
from pdserve.transfer.peer import PeerId
from pdserve.transfer.permits import Permits
from pdserve.transfer.tcp.pool import PoolGate
from tests.transfer.test_tcp import pool

PEER = PeerId(7, "127.0.0.1", 9)
LAYERS = (0, 2)


def test_revoke_waits_for_a_use_in_progress_and_refuses_the_next():
    permits = Permits()
    permits.allow("write", 1, PEER, [3, 4])
    assert permits.use("write", 1, PEER, [3], LAYERS, "conn") is None
    ended = threading.Event()

    def land() -> None:
        time.sleep(0.2)
        ended.set()
        permits.done(1, "conn")

    threading.Thread(target=land).start()
    assert permits.revoke(1, wait_s=5.0) == []
    assert ended.is_set(), "revoke returned while a frame was still landing"
    refusal = permits.use("write", 1, PEER, [4], LAYERS, "conn")
    assert refusal is not None and refusal.late


def test_revoke_names_the_holders_still_in_use_after_the_wait():
    permits = Permits()
    permits.allow("read", 2, PEER, [0])
    assert permits.use("read", 2, PEER, [0], LAYERS, "stuck") is None
    start = time.monotonic()
    assert permits.revoke(2, wait_s=0.05) == ["stuck"]
    assert time.monotonic() - start < 2.0
    permits.done(2, "stuck")
    assert permits.revoke(2) == []


def test_uses_of_other_transfers_do_not_hold_a_revoke():
    permits = Permits()
    permits.allow("write", 1, PEER, [0])
    permits.allow("write", 2, PEER, [1])
    assert permits.use("write", 2, PEER, [1], LAYERS, "other") is None
    assert permits.revoke(1, wait_s=5.0) == []
    assert permits.use("write", 2, PEER, [1], LAYERS, "other") is None  # still live
    permits.done(2, "other")
    permits.done(2, "other")


def test_a_refused_use_holds_nothing():
    permits = Permits()
    permits.allow("write", 1, PEER, [0])
    assert permits.use("write", 1, PEER, [5], LAYERS, "conn") is not None  # outside
    assert permits.revoke(1, wait_s=0.0) == []


def test_the_gate_shuts_a_connection_whose_frame_outlives_the_wait(caplog):
    gate = PoolGate(ThrottledLog(logging.getLogger("test")), wait_s=0.05)
    gate.register(pool(4))
    gate.permits.allow("write", 3, PEER, [1])
    landing, far = socket.socketpair()
    with caplog.at_level(logging.WARNING, logger="pdserve.transfer.tcp.pool"), \
            gate.use("write", PEER, 3, [1], None, landing) as refusal:
        assert refusal is None
        threading.Thread(target=gate.revoke, args=(3,)).start()
        assert far.recv(1) == b"", "the stuck frame's connection was not shut down"
    assert "dropping its connection" in caplog.text
    landing.close()
    far.close()


@pytest.mark.parametrize("kind", ["write", "read"])
def test_the_gate_refuses_outside_a_permit_and_says_why(kind):
    gate = PoolGate(ThrottledLog(logging.getLogger("test")), wait_s=0.05)
    gate.register(pool(4))
    a, b = socket.socketpair()
    with gate.use(kind, PEER, 9, [1], None, a) as refusal:
        assert refusal is not None and "has no" in refusal
    assert gate.permits.revoke(9) == []
    a.close()
    b.close()
