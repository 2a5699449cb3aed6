"""The TCP transport's bound handshake: a signed HELLO relayed from another address, an ACK
replayed as a HELLO, and a HELLO addressed to another endpoint or instance open nothing, write
nothing and mark nobody dead; the real pair keeps working."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdserve.engine.kv_cache import KVCache
from pdserve.transfer.peer import PeerId
from pdserve.transfer.tcp import TcpTransport
from pdserve.transfer.tcp.frames import HEADER, Frame, header
from tests.transfer.test_tcp import OPTS, SECRET, endpoint, finish, pool, wait_for
from tests.transfer.test_tcp_sealed import _pair_behind_relay

RELAY = Path(__file__).with_name("relay.py")
LOG = "pdserve.transfer.tcp"


@contextlib.contextmanager
def relay_to(port: int, inject: list[str]) -> Iterator[int]:
    """A relay child process in front of 127.0.0.1:`port` (tests/transfer/relay.py); its port."""
    child = subprocess.Popen([sys.executable, str(RELAY), str(port), "60", *inject],
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        yield int(child.stdout.readline())
    finally:
        child.kill()
        child.wait()


def injection(cache: KVCache, tid: int, block: int) -> list[str]:
    """relay.py's arguments for a WRITE of 0xAB bytes into every layer of `block`."""
    return ["--inject", str(block), "--tid", str(tid), "--layers", str(cache.num_layers),
            "--layer-bytes", str(cache.block_nbytes // cache.num_layers)]


def up_both_ways(a: TcpTransport, b: TcpTransport) -> None:
    a.send(b.local, b"ping")
    wait_for(lambda: b.receive() == [(a.local, b"ping")])
    b.send(a.local, b"pong")
    wait_for(lambda: a.receive() == [(b.local, b"pong")])


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_handshake_relayed_to_another_worker_is_refused_and_harms_nobody(encrypt, caplog):
    """W1 is lured into dialing a relay that claims to be W2 (W2's instance id, the relay's
    address). The relay forwards W1's signed HELLO to W2's KV port, then writes into a block
    W2 has reserved for a transfer from W1. W2 refuses the HELLO (it names the relay's
    address), so nothing lands, and the relayed connection ending marks nobody dead."""
    options = replace(OPTS, encrypt=encrypt)
    w1_pool, w2_pool = pool(16, seed=1), pool(16, seed=2)
    with (TcpTransport(secret=SECRET, options=options) as w1,
          TcpTransport(secret=SECRET, options=options) as w2,
          caplog.at_level(logging.WARNING, LOG)):
        w1.register(w1_pool)
        w2.register(w2_pool)
        up_both_ways(w1, w2)
        w2.allow_writes(5, w1.local, [3])  # a transfer from W1 into block 3 is under way
        before = w2_pool.data.clone()
        with relay_to(w2.local.port, injection(w2_pool, 5, 3)) as relay_port:
            lure = PeerId(w2.local.instance_id, "127.0.0.1", relay_port)
            w1.send(lure, b"for W2's eyes")
            assert finish(w1, w1.write(5, [1], lure, [3]), timeout=20.0) == "error"
            assert not w1.peer_alive(lure)
        wait_for(lambda: "is addressed to" in caplog.text)
        assert "refused connection from 127.0.0.1" in caplog.text
        assert torch.equal(w2_pool.data, before)
        assert w2.receive() == []
        assert w1.peer_alive(w2.local) and w2.peer_alive(w1.local)
        up_both_ways(w1, w2)
        assert finish(w1, w1.write(5, [1], w2.local, [3])) == "done"
        assert torch.equal(w2_pool.data[3], w1_pool.data[1])
        assert torch.equal(w2_pool.data[:3], before[:3])


def first_envelope(stream: bytes | bytearray) -> bytes:
    """The signed envelope of the first frame of a recorded stream (a HELLO or HELLO_ACK)."""
    plen = HEADER.unpack_from(stream)[4]
    return bytes(stream[HEADER.size:HEADER.size + plen])


def answered(port: int, ftype: Frame, envelope: bytes) -> bytes:
    """What an endpoint answers a greeting frame before it closes the connection."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10.0) as s:
        s.sendall(header(ftype, plen=len(envelope)) + envelope)
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(1 << 12):
                got += chunk
    return got


@pytest.mark.parametrize("replayed", ["ack as hello", "hello to another endpoint"])
def test_a_captured_greeting_replayed_to_a_third_worker_is_refused(replayed, caplog):
    """Fresh, correctly signed envelopes captured on the wire between A and B, replayed to C
    within the freshness window: C answers nothing, closes, and knows no one new."""
    a, b, relay = _pair_behind_relay(False)
    with a, b, endpoint() as c, caplog.at_level(logging.WARNING, LOG):
        up_both_ways(a, b)
        stream = relay.streams[0]
        hello, ack = first_envelope(stream.sent), first_envelope(stream.answered)
        envelope = ack if replayed == "ack as hello" else hello
        assert answered(c.local.port, Frame.HELLO, envelope) == b""
        wait_for(lambda: "refused connection from 127.0.0.1" in caplog.text)
        assert ("got kind 'ack'" if replayed == "ack as hello" else "is addressed to") \
            in caplog.text
        assert c.receive() == []
        assert a.peer_alive(b.local) and b.peer_alive(a.local)
        up_both_ways(a, b)
    relay.close()


def test_a_hello_for_another_instance_here_is_answered_then_refused_without_harm(caplog):
    """A dials B's address under an instance id B does not have (say, from before a restart):
    B answers so that A learns who is there, refuses, and keeps A alive."""
    a_pool, b_pool = pool(8, seed=1), pool(8)
    with endpoint(a_pool) as a, endpoint(b_pool) as b, caplog.at_level(logging.WARNING, LOG):
        ghost = PeerId(b.local.instance_id + 7, b.local.host, b.local.port)
        a.send(ghost, b"anyone?")
        wait_for(lambda: not a.peer_alive(ghost))
        wait_for(lambda: "so the dialer learns of the restart" in caplog.text)
        assert a.peer_alive(b.local) and b.peer_alive(a.local)
        assert b.receive() == []
        b.allow_writes(1, a.local, [2])
        assert finish(a, a.write(1, [4], b.local, [2])) == "done"
        assert torch.equal(b_pool.data[2], a_pool.data[4])
