"""The TCP transport's KV port under slow and many clients: the handshake has one deadline from
the accept, and the accepted connections are capped, without starving a real peer."""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from dataclasses import replace

import pytest

from pdserve.transfer.tcp import TcpOptions, TcpTransport
from pdserve.transfer.tcp.frames import Frame, header
from tests.transfer.test_tcp import OPTS, SECRET, endpoint, wait_for

LOG = "pdserve.transfer.tcp"


def closed_by_peer(s: socket.socket) -> bool:
    """The other end closed or reset the connection (nothing is ever sent to these clients)."""
    if not select.select([s], [], [], 0)[0]:
        return False
    try:
        return s.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def readers() -> int:
    """Reader threads of accepted connections in this process (only `b` accepts here)."""
    return sum(t.name.startswith("pdserve-tcp-read-") for t in threading.enumerate())


def test_a_hello_trickling_in_is_cut_off_at_the_handshake_deadline(caplog):
    """One byte a second, each well inside the old per-read timeout: the deadline counts from
    the accept, so the connection ends long before the HELLO could be complete."""
    opts = replace(OPTS, handshake_timeout_s=2.5)
    hello = header(Frame.HELLO, plen=300) + b"x" * 300
    budget = 12  # bytes, one a second
    with TcpTransport(secret=SECRET, options=opts) as b, caplog.at_level(logging.WARNING, LOG), \
            socket.create_connection(("127.0.0.1", b.local.port)) as s:
        sent = 0
        with contextlib.suppress(OSError):
            while sent < budget and not closed_by_peer(s):
                s.send(hello[sent:sent + 1])
                sent += 1
                time.sleep(1.0)
        assert sent < budget and closed_by_peer(s)
        wait_for(lambda: "not complete within 2.5 s of the accept" in caplog.text)
        assert "refused connection from 127.0.0.1" in caplog.text


def test_connections_beyond_the_cap_are_closed_and_a_real_peer_still_gets_in(caplog):
    """max_connections + 10 idle clients: the 10 are closed at once with one warning, at most
    max_connections reader threads ever run, and the rest are closed at the handshake
    deadline. A real peer dialing meanwhile is turned away, dials again, and gets in."""
    cap = 8
    opts = replace(OPTS, max_connections=cap)
    peak = 0

    def count_closed(idle: list[socket.socket]) -> int:
        nonlocal peak
        peak = max(peak, readers())
        return sum(closed_by_peer(s) for s in idle)

    with TcpTransport(secret=SECRET, options=opts) as b, endpoint() as a, \
            caplog.at_level(logging.WARNING, LOG):
        idle = [socket.create_connection(("127.0.0.1", b.local.port)) for _ in range(cap + 10)]
        try:
            wait_for(lambda: count_closed(idle) >= 10)
            a.send(b.local, b"let me in")  # while the idle clients may still hold every slot
            wait_for(lambda: count_closed(idle) == cap + 10)
            got: list = []
            wait_for(lambda: got.extend(b.receive()) or got, 10.0)
        finally:
            for s in idle:
                s.close()
        assert got == [(a.local, b"let me in")]
        assert peak <= cap
        assert a.peer_alive(b.local) and b.peer_alive(a.local)
        assert caplog.text.count("TcpOptions.max_connections") == 1  # rate-limited


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_max_connections_is_validated(bad):
    with pytest.raises(ValueError, match="max_connections"):
        TcpOptions(max_connections=bad)
