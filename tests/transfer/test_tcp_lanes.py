"""Control messages on a connection of their own: one sent while the bulk connection is stalled
mid-write still arrives, and the write ends once the stall does; with one connection per peer
(`control_connection=False`) the same message waits for the stall."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from pdserve.transfer.tcp import TcpTransport
from tests.transfer.test_tcp import OPTS, finish, pool, wait_for
from tests.transfer.test_tcp_read_frames import holder_behind_relay

STALL_AFTER = 1 << 20  # bytes a connection carries before the relay stalls it


def stalling(released: threading.Event, stalled: threading.Event
             ) -> Callable[[], Callable[[int, bytes], bytes]]:
    """A relay edit that holds each connection's bytes past STALL_AFTER (setting `stalled`)
    until `released`: only a bulk connection gets that far."""
    def editor() -> Callable[[int, bytes], bytes]:
        def edit(offset: int, data: bytes) -> bytes:
            if offset + len(data) > STALL_AFTER:
                stalled.set()
                released.wait(30)
            return data
        return edit
    return editor


def received(tx: TcpTransport) -> list:
    got: list = []
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline and not got:
        got += tx.receive()
        time.sleep(0.005)
    return got


@pytest.mark.parametrize("control_connection", [True, False])
def test_a_control_message_passes_a_stalled_bulk_connection(control_connection):
    src, dst = pool(2048, seed=3), pool(2048)
    blocks = list(range(2048))  # 64 MiB
    released, stalled = threading.Event(), threading.Event()
    options = replace(OPTS, control_connection=control_connection)
    try:
        with holder_behind_relay(options, edit=stalling(released, stalled)) as (a, b, relay):
            a.register(src)
            b.register(dst)
            b.allow_writes(1, a.local, blocks)
            handle = a.write(1, blocks, b.local, blocks)
            wait_for(stalled.is_set, timeout=10)
            a.send(b.local, b"urgent")
            got = received(b)
            if control_connection:
                assert got == [(a.local, b"urgent")]
                assert a.status(handle) == "pending", "the write was not stalled"
            else:
                assert got == [], "one connection: the message should wait behind the stall"
            released.set()
            assert finish(a, handle, timeout=30) == "done"
            assert torch.equal(dst.data, src.data)
            if not control_connection:
                wait_for(lambda: b.receive() == [(a.local, b"urgent")])
            assert len(relay.streams) == (2 if control_connection else 1)
    finally:
        released.set()


def test_reach_dials_both_connections_and_links_report_the_bulk_one():
    with holder_behind_relay() as (a, b, relay):
        a.reach(b.local)
        wait_for(lambda: len(relay.streams) == 2)
        a.register(pool(4, seed=1))
        b.register(pool(4))
        b.allow_writes(1, a.local, [0, 1])
        assert finish(a, a.write(1, [0, 1], b.local, [0, 1]), b) == "done"
        assert len(a.links()) == 1
