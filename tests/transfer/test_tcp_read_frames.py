"""A pull answered in READ_DATA frames: several on a paced connection, control messages between
them, the permit checked at each, one frame with `frame_s=0`, and a frame that does not
continue its read is a protocol error. The holder `a` dials the reader `b` through a relay
that records what `a` sends, so the frames are read off the wire."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from pdserve.transfer.tcp import TcpOptions, TcpTransport
from pdserve.transfer.tcp.frames import HEADER, Frame
from tests.transfer.test_tcp import MODEL, OPTS, SECRET, finish, mapping, pool, wait_for
from tests.transfer.test_tcp_sealed import Relay


@dataclass(frozen=True)
class Sent:
    """One frame `a` sent: its type, count and, for READ_DATA, the prefix (layers, ids)."""

    ftype: Frame
    count: int
    layers: tuple[int, int] = (0, 0)
    ids: tuple[int, ...] = ()
    payload: bytes = b""  # a CONTROL frame's message


def frames_sent(stream: bytes) -> list[Sent]:
    """Every frame of a plain stream, the handshake's first."""
    out, at = [], 0
    while at + HEADER.size <= len(stream):
        ftype, count, _, _, plen = HEADER.unpack_from(stream, at)
        body = at + HEADER.size
        if ftype == Frame.READ_DATA:
            first, end, *ids = struct.unpack_from(f"<{2 + count}I", stream, body)
            out.append(Sent(Frame.READ_DATA, count, (first, end), tuple(ids)))
        else:
            out.append(Sent(Frame(ftype), count, payload=bytes(stream[body : body + plen])))
        at = body + plen
    return out


def read_data(sent: list[Sent]) -> list[Sent]:
    return [s for s in sent if s.ftype is Frame.READ_DATA]


def bulk_frames(relay: Relay) -> list[Sent]:
    """The frames `a` sent on its bulk connection (the one that carried READ_DATA)."""
    streams = [frames_sent(s) for s in relay.sent()]
    bulk = [f for f in streams if read_data(f)]
    assert len(bulk) == 1, f"READ_DATA on {len(bulk)} of {len(streams)} connections"
    return bulk[0]


@contextmanager
def holder_behind_relay(options: TcpOptions = OPTS,
                        edit: Callable[[], Callable[[int, bytes], bytes]] | None = None,
                        ) -> Iterator[tuple[TcpTransport, TcpTransport, Relay]]:
    """(a, b, relay): `a` reaches `b` only through `relay` (b advertises the relay's port)."""
    probe = socket.create_server(("127.0.0.1", 0))
    b_port = probe.getsockname()[1]
    probe.close()
    relay = Relay(b_port, edit)
    try:
        with TcpTransport(secret=SECRET, options=options) as a, \
                TcpTransport(port=b_port, secret=SECRET, options=options,
                             advertise_port=relay.port) as b:
            yield a, b, relay
    finally:
        relay.close()


def landed(dst, d: int, src, s: int) -> bool:
    return torch.equal(dst.data[d], src.data[s])


def test_a_pull_of_many_blocks_arrives_in_several_frames_and_lands_byte_exact() -> None:
    src, dst = pool(400, seed=5), pool(400)
    s, d = mapping(300, seed=6)
    with holder_behind_relay() as (a, b, relay):
        a.register(src)
        b.register(dst)
        a.allow_reads(3, b.local, s)
        assert finish(b, b.read(3, d, a.local, s), a) == "done"
        assert torch.equal(dst.data[d], src.data[s])
        untouched = sorted(set(range(400)) - set(d))
        assert not dst.data[untouched].any()
        frames = read_data(bulk_frames(relay))
    assert len(frames) > 1, "one READ_DATA frame for the whole pull"
    covered = [(i, layer) for f in frames for i in f.ids
               for layer in range(*f.layers)]
    assert covered == [(i, layer) for i in s for layer in range(MODEL.num_layers)]


def test_frame_s_0_answers_a_pull_in_one_frame() -> None:
    src, dst = pool(400, seed=7), pool(400)
    s, d = mapping(300, seed=8)
    with holder_behind_relay(replace(OPTS, frame_s=0)) as (a, b, relay):
        a.register(src)
        b.register(dst)
        a.allow_reads(3, b.local, s)
        assert finish(b, b.read(3, d, a.local, s), a) == "done"
        assert torch.equal(dst.data[d], src.data[s])
        frames = read_data(bulk_frames(relay))
    assert frames == [Sent(Frame.READ_DATA, 300, (0, MODEL.num_layers), tuple(s))]


def test_a_control_message_overtakes_the_rest_of_a_large_read() -> None:
    src, dst = pool(2048, seed=9), pool(2048)
    blocks = list(range(2048))  # 64 MiB
    with holder_behind_relay() as (a, b, relay):
        a.register(src)
        b.register(dst)
        a.allow_reads(4, b.local, blocks)
        handle = b.read(4, blocks, a.local, blocks)
        wait_for(lambda: landed(dst, 0, src, 0), timeout=10)  # its first frame is out
        a.send(b.local, b"urgent")
        got: list = []
        wait_for(lambda: got.extend(b.receive()) or got)
        assert got == [(a.local, b"urgent")]
        assert not landed(dst, 2047, src, 2047), "the control message waited for the read"
        assert finish(b, handle, a) == "done"
        assert torch.equal(dst.data, src.data)
        streams = [frames_sent(s) for s in relay.sent()]
    urgent = Sent(Frame.CONTROL, 0, payload=b"urgent")
    (control,) = [f for f in streams if urgent in f]
    assert not read_data(control), "the control message shared the bulk connection"


def test_a_read_whose_permit_ends_part_way_is_refused_the_rest_and_fails() -> None:
    src, dst = pool(2048, seed=10), pool(2048)
    blocks = list(range(2048))
    with holder_behind_relay() as (a, b, relay):
        a.register(src)
        b.register(dst)
        a.allow_reads(5, b.local, blocks)
        handle = b.read(5, blocks, a.local, blocks)
        wait_for(lambda: landed(dst, 0, src, 0), timeout=10)
        a.revoke(5)
        assert finish(b, handle, a) == "error"
        assert not landed(dst, 2047, src, 2047), "the read went on after its permit ended"
        assert b.peer_alive(a.local) and a.peer_alive(b.local), "a refusal kills nobody"
        a.allow_reads(6, b.local, [2047])  # the connection still serves reads
        assert finish(b, b.read(6, [2047], a.local, [2047]), a) == "done"
        assert landed(dst, 2047, src, 2047)
        sent = bulk_frames(relay)
    refused = [i for i, f in enumerate(sent) if f.ftype is Frame.READ_ERROR]
    assert len(refused) == 1 and sent[refused[0]].payload.startswith(b"not permitted")
    before = read_data(sent[: refused[0]])
    assert before and sum(len(f.ids) * (f.layers[1] - f.layers[0])
                          for f in before) < 2048 * MODEL.num_layers


class FirstReadDataEdit:
    """A relay edit that names block `block` (< 256) instead of block 0 first in the first
    READ_DATA frame's prefix (the low byte of its first id)."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.seen = bytearray()
        self.next_frame = 0
        self.target: int | None = None  # offset of the first frame's first block id

    def __call__(self, offset: int, data: bytes) -> bytes:
        self.seen += data
        while self.target is None and self.next_frame + HEADER.size <= len(self.seen):
            ftype, _, _, _, plen = HEADER.unpack_from(self.seen, self.next_frame)
            if ftype == Frame.READ_DATA:
                self.target = self.next_frame + HEADER.size + 8
            self.next_frame += HEADER.size + plen
        if self.target is None or not offset <= self.target < offset + len(data):
            return data
        at = self.target - offset
        return data[:at] + bytes([self.block]) + data[at + 1:]


def test_a_read_data_frame_that_does_not_continue_its_read_is_a_protocol_error() -> None:
    src, dst = pool(8, seed=11), pool(8)
    with holder_behind_relay(edit=lambda: FirstReadDataEdit(block=7)) as (a, b, _):
        a.register(src)
        b.register(dst)
        a.allow_reads(7, b.local, [0, 1, 2])
        assert finish(b, b.read(7, [3, 4, 5], a.local, [0, 1, 2]), a) == "error"
        wait_for(lambda: not b.peer_alive(a.local))
        assert "does not continue its read" in (b.why_dead(a.local) or "")
        assert not dst.data.any(), "a malformed frame landed"
