"""The TCP transport sealed with AES-256-GCM: what crosses the wire is ciphertext, a flipped bit
ends the move and the peer (never lands as data the session trusts), and a sealed endpoint
refuses a plain one with a reason on both sides. The shared suite (test_conformance.py) also
runs every move and session through the sealed transport."""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch

from pdserve.transfer.tcp import TcpTransport
from pdserve.transfer.tcp.frames import Frame, ProtocolError, header
from pdserve.transfer.tcp.wire import TAG_BYTES, Wire
from tests.transfer.test_tcp import OPTS, SECRET, finish, pool, wait_for

SEALED = dataclasses.replace(OPTS, encrypt=True)
MARK = bytes(range(256)) * 8  # 2 KiB a block's bytes carry, easy to spot in a capture


@dataclass
class Stream:
    """One relayed connection: what the dialer sent (after the edit) and the acceptor answered."""

    sent: bytearray = field(default_factory=bytearray)
    answered: bytearray = field(default_factory=bytearray)


class Relay:
    """A TCP relay in front of one endpoint, for every connection dialed through it (an
    endpoint dials two per peer: control and bulk). Each is a `Stream` in `streams`, in the
    order accepted; `edit()`, when given, makes each connection's editor
    `editor(offset, data) -> data`, offset counted over that connection's dialer-to-acceptor
    bytes."""

    def __init__(self, target_port: int,
                 edit: Callable[[], Callable[[int, bytes], bytes]] | None = None) -> None:
        self.target_port, self.edit = target_port, edit
        self.streams: list[Stream] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._socks: list[socket.socket] = [self._server]
        threading.Thread(target=self._accept, daemon=True).start()

    def sent(self) -> list[bytes]:
        """What the dialer sent on each connection."""
        return [bytes(s.sent) for s in self.streams]

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._socks += [client, upstream]
            stream = Stream()
            self.streams.append(stream)
            editor = None if self.edit is None else self.edit()
            threading.Thread(target=self._pump, args=(client, upstream, stream.sent, editor),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, stream.answered, None),
                             daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray,
              editor: Callable[[int, bytes], bytes] | None) -> None:
        try:
            while data := src.recv(1 << 16):
                if editor is not None:
                    data = editor(len(record), data)
                record += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        for s in self._socks:
            s.close()


def _pair_behind_relay(encrypt: bool,
                       edit: Callable[[], Callable[[int, bytes], bytes]] | None = None
                       ) -> tuple[TcpTransport, TcpTransport, Relay]:
    """a -> relay -> b: b advertises the relay's port, so a dials b through it."""
    options = SEALED if encrypt else OPTS
    probe = socket.create_server(("127.0.0.1", 0))
    b_port = probe.getsockname()[1]
    probe.close()
    relay = Relay(b_port, edit)
    a = TcpTransport(secret=SECRET, options=options)
    b = TcpTransport(port=b_port, secret=SECRET, options=options, advertise_port=relay.port)
    return a, b, relay


def _bytes(cache) -> torch.Tensor:
    return cache.data.view(torch.uint8).reshape(cache.data.shape[0], -1)


@pytest.fixture
def marked_pools() -> Iterator[tuple]:
    a_pool, b_pool = pool(8), pool(8)
    _bytes(a_pool)[:, : len(MARK)] = torch.frombuffer(
        bytearray(MARK), dtype=torch.uint8)
    yield a_pool, b_pool


@pytest.mark.parametrize("encrypt", [False, True])
def test_block_bytes_cross_the_wire_only_as_ciphertext_when_sealed(marked_pools, encrypt):
    a_pool, b_pool = marked_pools
    a, b, relay = _pair_behind_relay(encrypt)
    with a, b:
        a.register(a_pool)
        b.register(b_pool)
        b.allow_writes(1, a.local, [5, 6, 7])
        assert finish(a, a.write(1, [0, 1, 2], b.local, [5, 6, 7]), b) == "done"
        assert torch.equal(_bytes(b_pool)[[5, 6, 7]], _bytes(a_pool)[[0, 1, 2]])
        a.send(b.local, b"control message in the clear?")
        got: list = []
        wait_for(lambda: got.extend(b.receive()) or got)
        assert got == [(a.local, b"control message in the clear?")]
    relay.close()
    wires = relay.sent()
    assert len(wires) == 2, "a control and a bulk connection"
    assert max(len(w) for w in wires) > 3 * a_pool.block_nbytes
    assert any(MARK[:64] in w for w in wires) is not encrypt
    assert any(b"in the clear" in w for w in wires) is not encrypt


def test_a_flipped_bit_fails_the_move_and_the_peer_and_never_completes(marked_pools, caplog):
    a_pool, b_pool = marked_pools
    flip_at = 4 * a_pool.block_nbytes  # inside the block records, after the handshake

    def flip(offset: int, data: bytes) -> bytes:
        if offset <= flip_at < offset + len(data):
            i = flip_at - offset
            return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]
        return data

    a, b, relay = _pair_behind_relay(True, lambda: flip)
    with a, b, caplog.at_level(logging.WARNING, logger="pdserve.transfer.tcp"):
        a.register(a_pool)
        b.register(b_pool)
        b.allow_writes(1, a.local, [0, 1])
        b.allow_writes(2, a.local, list(range(8)))
        first = a.write(1, [0, 1], b.local, [0, 1])
        assert finish(a, first, b) == "done"  # 2 blocks: the flip lies beyond them
        second = a.write(2, list(range(8)), b.local, list(range(8)))
        assert finish(a, second, b) == "error"
        wait_for(lambda: not b.peer_alive(a.local))
        assert not a.peer_alive(b.local)
    relay.close()
    assert "failed authentication" in caplog.text


@pytest.mark.parametrize("dialer_sealed", [True, False])
def test_a_sealed_and_a_plain_endpoint_refuse_each_other_saying_why(dialer_sealed, caplog):
    a_opts, b_opts = (SEALED, OPTS) if dialer_sealed else (OPTS, SEALED)
    with (caplog.at_level(logging.WARNING, logger="pdserve.transfer.tcp"),
          TcpTransport(secret=SECRET, options=a_opts) as a,
          TcpTransport(secret=SECRET, options=b_opts) as b):
        a.register(pool(2))
        b.register(pool(2))
        assert finish(a, a.write(1, [0], b.local, [1]), b) == "error"
        wait_for(lambda: caplog.text.count("KV cipher") >= 2)
    assert "refused connection" in caplog.text  # the acceptor
    assert "is dead" in caplog.text  # the dialer gives the peer up, with the same reason


def _sealed_pair(key: bytes = b"k" * 32) -> tuple[Wire, Wire, socket.socket, socket.socket]:
    x, y = socket.socketpair()
    return Wire(x, key), Wire(y, key), x, y


def test_records_round_trip_and_small_parts_share_one_send():
    tx, rx, x, y = _sealed_pair()
    block = memoryview(bytearray(range(256)) * 512)  # 128 KiB: sealed into scratch
    tx.send([header(Frame.WRITE, 1, 7, 9, 4 + len(block)), b"\x05\x00\x00\x00", block])
    assert rx.recv_header() == (Frame.WRITE, 1, 7, 9, 4 + len(block))
    assert rx.recv_exact(4) == b"\x05\x00\x00\x00"
    out = memoryview(bytearray(len(block)))
    rx.recv_into(out)
    assert out == block
    x.close()
    with pytest.raises(EOFError):
        rx.recv_header()
    y.close()


@pytest.mark.parametrize("attack", ["replay", "reorder", "other key"])
def test_a_replayed_reordered_or_foreign_record_fails_authentication(attack):
    _, rx, x, y = _sealed_pair()
    spy_tx, _, sx, sy = _sealed_pair()
    first, second = header(Frame.CONTROL, plen=1), header(Frame.CONTROL, plen=2)
    spy_tx.send([first])
    spy_tx.send([second])
    rec1 = sy.recv(32 + TAG_BYTES, socket.MSG_WAITALL)
    rec2 = sy.recv(32 + TAG_BYTES, socket.MSG_WAITALL)
    if attack == "replay":
        x.sendall(rec1 + rec1)
        assert rx.recv_header()[0] is Frame.CONTROL
    elif attack == "reorder":
        x.sendall(rec2 + rec1)
    else:
        Wire(x, b"o" * 32).send([first])
    with pytest.raises(ProtocolError, match="failed authentication"):
        rx.recv_header()
    for s in (x, y, sx, sy):
        s.close()
