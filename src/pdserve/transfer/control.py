"""Small control messages of a transfer session, and one decoder for every message kind.

Two kinds join the descriptor (1) and the completion notice (2), framed the same way
(`wire.py`: versioned, strict decode, no pickle):

- kind 3, `Reservation` (receiver -> sender, both modes): the destination blocks the receiver
  reserved and their generations. The sender answers with the full `TransferDescriptor`
  (the receiver cannot write one: it does not know the sender's source block ids).
- kind 4, `ControlMessage`: ABORT (with a reason), ABORT_ACK (the writer has stopped and will
  never write again), ACK (push: verified, the sender may free), RELEASE (pull: read and
  verified, the sender may free). No body; the header names the author, which the session
  checks against the peer it was set up with.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from pdserve.transfer.descriptors import CompletionNotice, KVLayout, PeerId, TransferDescriptor
from pdserve.transfer.wire import (
    FRAME,
    KIND_DESCRIPTOR,
    KIND_NOTICE,
    PROTOCOL_VERSION,
    U32,
    U64,
    as_tuple,
    check_version,
    exact_keys,
    hex64,
    pack,
    parse_hex64,
    read_arrays,
    require_int,
    require_ints,
    unpack,
)

KIND_RESERVATION = 3
KIND_CONTROL = 4
MAX_REASON_CHARS = 1024
# The ABORT reason a sender gives when token 0 already ended the request: there is nothing to
# move, and the receiver should end its leg rather than recompute.
FINISHED_AT_TOKEN0 = "the request finished at token 0; no KV will be sent"


class ControlOp(StrEnum):
    ABORT = "abort"
    ABORT_ACK = "abort_ack"
    ACK = "ack"
    RELEASE = "release"


@dataclass(frozen=True)
class ControlMessage:
    """One control word about one transfer, written by `author`.

    `reason` is non-empty exactly for ABORT (at most MAX_REASON_CHARS characters).
    """

    transfer_id: int
    author: PeerId
    op: ControlOp
    reason: str = ""
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        check_version(self.protocol_version)
        require_int("transfer_id", self.transfer_id, 0, U64)
        if not isinstance(self.author, PeerId):
            raise ValueError("author must be a PeerId")
        if not isinstance(self.op, ControlOp):
            raise ValueError(f"op must be a ControlOp, got {self.op!r}")
        if type(self.reason) is not str or len(self.reason) > MAX_REASON_CHARS:
            raise ValueError(f"reason must be a string of at most {MAX_REASON_CHARS} chars")
        if (self.op is ControlOp.ABORT) != bool(self.reason):
            raise ValueError("give a non-empty reason exactly for ABORT")

    def encode(self) -> bytes:
        header = {"transfer_id": hex64(self.transfer_id), "author": self.author.to_json(),
                  "op": self.op.value, "reason": self.reason}
        return pack(KIND_CONTROL, self.protocol_version, header, [])

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> ControlMessage:
        version, raw, body = unpack(data, KIND_CONTROL)
        h = exact_keys("control header", raw, ["transfer_id", "author", "op", "reason"])
        read_arrays(body, [])
        if h["op"] not in {op.value for op in ControlOp}:
            raise ValueError(f"unknown control op {h['op']!r}")
        return cls(parse_hex64("transfer_id", h["transfer_id"]), PeerId.from_json(h["author"]),
                   ControlOp(h["op"]), h["reason"], version)


@dataclass(frozen=True)
class Reservation:
    """The receiver's reserved destination blocks: where the KV of a transfer must land.

    Block i of the transfer lands in `dst_block_ids[i]`, which carries `dst_generations[i]`
    while the reservation lives. Layers [layer_begin, layer_end) of `layout`.
    """

    transfer_id: int
    receiver: PeerId
    dst_block_ids: tuple[int, ...]
    dst_generations: tuple[int, ...]
    layer_begin: int
    layer_end: int
    layout: KVLayout
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        check_version(self.protocol_version)
        require_int("transfer_id", self.transfer_id, 0, U64)
        as_tuple(self, "dst_block_ids")
        as_tuple(self, "dst_generations")
        if not isinstance(self.receiver, PeerId) or not isinstance(self.layout, KVLayout):
            raise ValueError("receiver must be a PeerId and layout a KVLayout")
        n = len(self.dst_block_ids)
        if n == 0 or len(self.dst_generations) != n:
            raise ValueError(f"need one generation per destination block, at least one block; "
                             f"got {n} blocks, {len(self.dst_generations)} generations")
        require_ints("dst_block_ids", self.dst_block_ids, U32)
        require_ints("dst_generations", self.dst_generations, U64)
        if len(set(self.dst_block_ids)) != n:
            raise ValueError("dst_block_ids must not repeat a block")
        require_int("layer_begin", self.layer_begin, 0, self.layout.num_layers)
        require_int("layer_end", self.layer_end, self.layer_begin + 1,
                    self.layout.num_layers + 1)

    @property
    def num_blocks(self) -> int:
        return len(self.dst_block_ids)

    def encode(self) -> bytes:
        header = {"transfer_id": hex64(self.transfer_id), "receiver": self.receiver.to_json(),
                  "layers": [self.layer_begin, self.layer_end],
                  "layout": self.layout.to_json(), "num_blocks": self.num_blocks}
        arrays = [np.asarray(self.dst_block_ids, dtype="<u4"),
                  np.asarray(self.dst_generations, dtype="<u8")]
        return pack(KIND_RESERVATION, self.protocol_version, header, arrays)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Reservation:
        version, raw, body = unpack(data, KIND_RESERVATION)
        h = exact_keys("reservation header", raw,
                       ["transfer_id", "receiver", "layers", "layout", "num_blocks"])
        n = require_int("num_blocks", h["num_blocks"], 1, U32)
        layers = h["layers"]
        if type(layers) is not list or len(layers) != 2:
            raise ValueError(f"layers must be [begin, end], got {layers!r}")
        dst, gen = read_arrays(body, [("<u4", n), ("<u8", n)])
        return cls(parse_hex64("transfer_id", h["transfer_id"]),
                   PeerId.from_json(h["receiver"]), tuple(dst), tuple(gen),
                   require_int("layer_begin", layers[0], 0, U32),
                   require_int("layer_end", layers[1], 0, U32),
                   KVLayout.from_json(h["layout"]), version)


Message = TransferDescriptor | CompletionNotice | Reservation | ControlMessage

_DECODERS = {
    KIND_DESCRIPTOR: TransferDescriptor.decode,
    KIND_NOTICE: CompletionNotice.decode,
    KIND_RESERVATION: Reservation.decode,
    KIND_CONTROL: ControlMessage.decode,
}


def decode_any(data: bytes | bytearray | memoryview) -> Message:
    """Decode any transfer-plane message by the kind in its frame; ValueError if malformed."""
    if not isinstance(data, bytes | bytearray | memoryview) or len(data) < FRAME.size:
        raise ValueError("truncated or non-bytes transfer message")
    decoder = _DECODERS.get(bytes(data[6:7])[0])
    if decoder is None:
        raise ValueError(f"unknown message kind {bytes(data[6:7])[0]}")
    return decoder(data)


def message_author(msg: Message) -> PeerId:
    """The peer a message says wrote it."""
    if isinstance(msg, Reservation):
        return msg.receiver
    if isinstance(msg, ControlMessage):
        return msg.author
    return msg.sender


def message_kind(msg: Message) -> str:
    """A short name for fault selection and logs: descriptor, notice, reservation, or the op."""
    if isinstance(msg, ControlMessage):
        return msg.op.value
    return {TransferDescriptor: "descriptor", CompletionNotice: "notice",
            Reservation: "reservation"}[type(msg)]
