"""The congestion control of the connections an endpoint dials: the one asked for where the
kernel gives it, else the host's default with a line in the log, and never a lost message."""

from __future__ import annotations

import logging
import socket
from dataclasses import replace

import pytest

from pdserve.transfer.tcp import TcpOptions, TcpTransport
from pdserve.transfer.tcp.options import CA_NAME_MAX
from tests.transfer.test_tcp import OPTS, SECRET, wait_for


def _congestion_after_a_message(options: TcpOptions) -> str:
    """Send one message from an endpoint with `options` to another; the congestion control of
    the connections it dialed (control and bulk: one and the same)."""
    with TcpTransport(secret=SECRET, options=options) as a, \
            TcpTransport(secret=SECRET, options=OPTS) as b:
        a.send(b.local, b"hello")
        got: list = []
        wait_for(lambda: got.extend(b.receive()) or got)
        assert [m for _, m in got] == [b"hello"]
        a.reach(b.local)
        senders = list(a._send._senders.values())  # the dialed connections
        wait_for(lambda: all(s.sock is not None for s in senders))
        names = {_congestion_of(s.sock) for s in senders if s.sock is not None}
        assert len(senders) == 2 and len(names) == 1
        return names.pop()


def _congestion_of(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION,
                           CA_NAME_MAX).rstrip(b"\0").decode()


def _host_default() -> str:
    with socket.socket() as s:
        return _congestion_of(s)


def test_a_dialed_connection_uses_the_congestion_control_asked_for() -> None:
    # reno is built into every Linux kernel and always allowed
    assert _congestion_after_a_message(replace(OPTS, congestion="reno")) == "reno"


def test_an_unknown_congestion_control_keeps_the_hosts_and_the_message_goes_through(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pdserve.transfer"):
        used = _congestion_after_a_message(replace(OPTS, congestion="nosuchcc"))
    assert used == _host_default()
    assert any("keeps the host's congestion control, not nosuchcc" in r.getMessage()
               for r in caplog.records), caplog.text


def test_an_empty_name_keeps_the_hosts_default() -> None:
    assert _congestion_after_a_message(replace(OPTS, congestion="")) == _host_default()


@pytest.mark.parametrize("bad", ["cu bic", "x" * 16, "cubic\n", "é"])
def test_a_congestion_control_name_is_validated(bad: str) -> None:
    with pytest.raises(ValueError, match=r"TcpOptions\.congestion"):
        TcpOptions(congestion=bad)
