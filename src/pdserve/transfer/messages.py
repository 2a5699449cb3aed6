"""Every message that crosses between the two sessions of a transfer, and one decoder for all.

Direction: `sender` is the peer whose blocks hold the KV (prefill), `receiver` the peer whose
blocks it lands in (decode), whichever of them writes the message (push or pull).

- kind 1, `TransferDescriptor` (sender -> receiver): which source blocks go into which
  reserved destination blocks, for which layers, with the checksums once known.
- kind 2, `CompletionNotice` (sender -> receiver): every slice is written (push) or may be
  read (pull); the sender's CRC32C per slice and token 0.
- kind 3, `Reservation` (receiver -> sender, both modes): the destination blocks the receiver
  reserved and their generations. The sender answers with the full `TransferDescriptor`
  (the receiver cannot write one: it does not know the sender's source block ids).
- kind 4, `ControlMessage`: ABORT (with a reason), ABORT_ACK (the writer has stopped and will
  never write again), ACK (push: verified, the sender may free), RELEASE (pull: read and
  verified, the sender may free), HOLD (either side: "this transfer is alive here and waits
  for compute or for pool room, not for you": the peer's session renews its lease; sent
  every lease/3 while the author holds the id without a session of its own, or, a prefill,
  while the prompt still computes). No body; the header names the author, which the session
  checks against the peer it was set up with.

Versions: a new control op is a change inside one cluster (every worker runs the same build),
so HOLD did not change the protocol version. A build without it decodes HOLD as an unknown op,
which its inbox counts and drops: its leases then run from its session's opening, as before.

Wire format (language-neutral, versioned, no pickle; helpers in `wire.py`):

    offset 0   4 bytes  magic b"PDTX"
           4   u16 LE   protocol version
           6   u8       kind (above)
           7   u8       reserved, 0
           8   u32 LE   header length H
          12   H bytes  header: one UTF-8 JSON object, space-padded so the body starts 8-aligned
        12+H            body: little-endian integer arrays back to back, sizes from the header

64-bit ids travel as 16 lowercase hex digits (JSON numbers lose precision past 2^53 in many
languages). Descriptor body: src block ids u32[n], dst block ids u32[n], dst generations u64[n],
then checksums u32[n * layers] when `has_checksums`. Notice body: checksums u32[num_checksums].
Reservation body: dst block ids u32[n], dst generations u64[n]. Control: no body.
Decoding rejects anything not exactly this: wrong magic, version or kind, truncated or trailing
bytes, missing, unknown or duplicate header keys, wrong JSON types, inconsistent lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from pdserve.transfer.layout import KVLayout
from pdserve.transfer.peer import PeerId
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


def _check_layers(begin: int, end: int, layout: KVLayout) -> None:
    """ValueError unless [begin, end) is a non-empty range of `layout`'s layers."""
    require_int("layer_begin", begin, 0, layout.num_layers)
    require_int("layer_end", end, begin + 1, layout.num_layers + 1)


@dataclass(frozen=True)
class TransferDescriptor:
    """Which sender blocks go into which receiver blocks, for which layers.

    Block i of the transfer is `src_block_ids[i]` -> `dst_block_ids[i]`, and the destination
    block must still carry `dst_generations[i]` when the KV is admitted (else it was reused).
    `checksums` is empty until known, else one CRC32C per (block, layer) slice, block-major.
    """

    transfer_id: int
    sender: PeerId
    receiver: PeerId
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    dst_generations: tuple[int, ...]
    layer_begin: int
    layer_end: int
    layout: KVLayout
    checksums: tuple[int, ...] = ()
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        check_version(self.protocol_version)
        require_int("transfer_id", self.transfer_id, 0, U64)
        for name in ("src_block_ids", "dst_block_ids", "dst_generations", "checksums"):
            as_tuple(self, name)
        if not isinstance(self.sender, PeerId) or not isinstance(self.receiver, PeerId):
            raise ValueError("sender and receiver must be PeerId instances")
        if not isinstance(self.layout, KVLayout):
            raise ValueError("layout must be a KVLayout")
        self._check_blocks()
        _check_layers(self.layer_begin, self.layer_end, self.layout)
        require_ints("checksums", self.checksums, U32)
        if self.checksums and len(self.checksums) != self.num_slices:
            raise ValueError(f"checksums: expected one per (block, layer) slice, "
                             f"{self.num_slices}, got {len(self.checksums)}")

    def _check_blocks(self) -> None:
        n = len(self.src_block_ids)
        if n == 0:
            raise ValueError("a transfer moves at least one block; src_block_ids is empty")
        if len(self.dst_block_ids) != n or len(self.dst_generations) != n:
            raise ValueError(
                f"src_block_ids, dst_block_ids and dst_generations must have one entry per "
                f"block; got {n}, {len(self.dst_block_ids)}, {len(self.dst_generations)}"
            )
        require_ints("src_block_ids", self.src_block_ids, U32)
        require_ints("dst_block_ids", self.dst_block_ids, U32)
        require_ints("dst_generations", self.dst_generations, U64)
        for name in ("src_block_ids", "dst_block_ids"):
            if len(set(getattr(self, name))) != n:
                raise ValueError(f"{name} must not repeat a block")


    @property
    def num_blocks(self) -> int:
        return len(self.src_block_ids)

    @property
    def layers(self) -> range:
        return range(self.layer_begin, self.layer_end)

    @property
    def num_slices(self) -> int:
        return self.num_blocks * len(self.layers)

    def encode(self) -> bytes:
        header = {
            "transfer_id": hex64(self.transfer_id),
            "sender": self.sender.to_json(),
            "receiver": self.receiver.to_json(),
            "layers": [self.layer_begin, self.layer_end],
            "layout": self.layout.to_json(),
            "num_blocks": self.num_blocks,
            "has_checksums": bool(self.checksums),
        }
        arrays = [
            np.asarray(self.src_block_ids, dtype="<u4"),
            np.asarray(self.dst_block_ids, dtype="<u4"),
            np.asarray(self.dst_generations, dtype="<u8"),
            np.asarray(self.checksums, dtype="<u4"),
        ]
        return pack(KIND_DESCRIPTOR, self.protocol_version, header, arrays)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> TransferDescriptor:
        version, raw, body = unpack(data, KIND_DESCRIPTOR)
        h = exact_keys("descriptor header", raw, [
            "transfer_id", "sender", "receiver", "layers", "layout", "num_blocks",
            "has_checksums"])
        n = require_int("num_blocks", h["num_blocks"], 1, U32)
        layers = h["layers"]
        if type(layers) is not list or len(layers) != 2:
            raise ValueError(f"layers must be [begin, end], got {layers!r}")
        begin = require_int("layer_begin", layers[0], 0, U32)
        end = require_int("layer_end", layers[1], 0, U32)
        if type(h["has_checksums"]) is not bool:
            raise ValueError("has_checksums must be true or false")
        num_crc = n * max(end - begin, 0) if h["has_checksums"] else 0
        src, dst, gen, crc = read_arrays(body, [("<u4", n), ("<u4", n), ("<u8", n),
                                                 ("<u4", num_crc)])
        return cls(
            parse_hex64("transfer_id", h["transfer_id"]), PeerId.from_json(h["sender"]),
            PeerId.from_json(h["receiver"]), tuple(src), tuple(dst), tuple(gen), begin, end,
            KVLayout.from_json(h["layout"]), tuple(crc), version,
        )


@dataclass(frozen=True)
class CompletionNotice:
    """The sender's word that every slice of a transfer was written (push) or may be read.

    `checksums` are the sender's CRC32C per (block, layer) slice in descriptor order. Token 0
    and its logprob ride along when the sender has them (the decode side continues from it).
    """

    transfer_id: int
    sender: PeerId
    checksums: tuple[int, ...]
    token0: int | None = None
    token0_logprob: float | None = None
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        check_version(self.protocol_version)
        require_int("transfer_id", self.transfer_id, 0, U64)
        if not isinstance(self.sender, PeerId):
            raise ValueError("sender must be a PeerId")
        as_tuple(self, "checksums")
        require_ints("checksums", self.checksums, U32)
        if self.token0 is not None:
            require_int("token0", self.token0, 0, U32)
        if self.token0_logprob is not None:
            self._check_logprob()

    def _check_logprob(self) -> None:
        lp = self.token0_logprob
        if self.token0 is None:
            raise ValueError("token0_logprob given without token0; send both or neither")
        if type(lp) not in (int, float) or not math.isfinite(lp) or lp > 0:
            raise ValueError(f"token0_logprob must be a finite number <= 0, got {lp!r}")
        object.__setattr__(self, "token0_logprob", float(lp))

    def encode(self) -> bytes:
        header = {
            "transfer_id": hex64(self.transfer_id),
            "sender": self.sender.to_json(),
            "num_checksums": len(self.checksums),
            "token0": self.token0,
            "token0_logprob": self.token0_logprob,
        }
        arrays = [np.asarray(self.checksums, dtype="<u4")]
        return pack(KIND_NOTICE, self.protocol_version, header, arrays)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> CompletionNotice:
        version, raw, body = unpack(data, KIND_NOTICE)
        h = exact_keys("notice header", raw, [
            "transfer_id", "sender", "num_checksums", "token0", "token0_logprob"])
        m = require_int("num_checksums", h["num_checksums"], 0, U32)
        (crc,) = read_arrays(body, [("<u4", m)])
        return cls(
            parse_hex64("transfer_id", h["transfer_id"]), PeerId.from_json(h["sender"]),
            tuple(crc), h["token0"], h["token0_logprob"], version,
        )


class ControlOp(StrEnum):
    ABORT = "abort"
    ABORT_ACK = "abort_ack"
    ACK = "ack"
    RELEASE = "release"
    HOLD = "hold"  # alive, waiting for compute or pool room: renews the peer's lease


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
        _check_layers(self.layer_begin, self.layer_end, self.layout)

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
