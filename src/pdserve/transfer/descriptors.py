"""What crosses the wire to move one request's KV: layouts, peers, descriptors, completions.

Direction: `sender` is the peer whose blocks hold the KV (prefill), `receiver` the peer whose
blocks it lands in (decode), whichever of them writes the message (push or pull).

Wire format (language-neutral, versioned, no pickle):

    offset 0   4 bytes  magic b"PDTX"
           4   u16 LE   protocol version
           6   u8       kind (1 = TransferDescriptor, 2 = CompletionNotice)
           7   u8       reserved, 0
           8   u32 LE   header length H
          12   H bytes  header: one UTF-8 JSON object, space-padded so the body starts 8-aligned
        12+H            body: little-endian integer arrays back to back, sizes from the header

64-bit ids travel as 16 lowercase hex digits (JSON numbers lose precision past 2^53 in many
languages). Descriptor body: src block ids u32[n], dst block ids u32[n], dst generations u64[n],
then checksums u32[n * layers] when `has_checksums`. Notice body: checksums u32[num_checksums].
Decoding rejects anything not exactly this: wrong magic, version or kind, truncated or trailing
bytes, missing, unknown or duplicate header keys, wrong JSON types, inconsistent lengths.
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

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
    require_str,
    unpack,
)

if TYPE_CHECKING:
    from pdserve.engine.kv_cache import KVCache


# The pool layout of `engine/kv_cache.py`; a (block, layer) slice is [2, block_size, kv_heads,
# head_dim]. A latent (MLA) pool will add its own name and slice shape here.
LAYOUT_PAGED_KV = "paged_kv[block,layer,kv=2,token,kv_head,head_dim]"
_SLICE_SHAPES = {
    LAYOUT_PAGED_KV: lambda lay: (2, lay.block_size, lay.kv_heads, lay.head_dim),
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


_instance: tuple[int, int] | None = None  # (pid, instance id)


def process_instance_id() -> int:
    """This process's random 64-bit instance id: drawn at first use, drawn anew in a forked
    child (a child is another instance even though it inherits the parent's memory)."""
    global _instance
    if _instance is None or _instance[0] != os.getpid():
        _instance = (os.getpid(), secrets.randbelow(U64 - 1) + 1)
    return _instance[1]


# -- layout and peers ----------------------------------------------------------------------------


@dataclass(frozen=True)
class KVLayout:
    """The shape of a peer's KV pool, as far as moving bytes between pools depends on it.

    `layout` names the pool layout and so the shape of one (block, layer) slice; nothing else
    here assumes K and V per head (a latent MLA pool is another `layout`).
    """

    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    layout: str = LAYOUT_PAGED_KV

    def __post_init__(self) -> None:
        require_str("KVLayout.model_id", self.model_id)
        if type(self.dtype) is not str or self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"KVLayout.dtype {self.dtype!r} unknown; use one of {sorted(DTYPE_BYTES)}"
            )
        for name in ("block_size", "num_layers", "kv_heads", "head_dim"):
            require_int(f"KVLayout.{name}", getattr(self, name), 1, U32)
        if type(self.layout) is not str or self.layout not in _SLICE_SHAPES:
            raise ValueError(f"KVLayout.layout {self.layout!r} unknown; this build knows "
                             f"{sorted(_SLICE_SHAPES)}")

    @classmethod
    def of_cache(cls, cache: KVCache, model_id: str) -> KVLayout:
        """The layout of an engine's `KVCache` (the paged layout)."""
        _, num_layers, _, block_size, kv_heads, head_dim = cache.data.shape
        dtype = str(cache.data.dtype).removeprefix("torch.")
        return cls(model_id, dtype, block_size, num_layers, kv_heads, head_dim)

    @property
    def slice_shape(self) -> tuple[int, ...]:
        """Shape of one (block, layer) slice of the pool."""
        return _SLICE_SHAPES[self.layout](self)

    @property
    def slice_nbytes(self) -> int:
        return math.prod(self.slice_shape) * DTYPE_BYTES[self.dtype]

    def check_compatible(self, other: KVLayout) -> None:
        """Raise ValueError naming the first field in which the two pools differ."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                raise ValueError(
                    f"incompatible KV layout: {f.name} is {mine!r} here but {theirs!r} at the "
                    "peer; both workers must serve the same model with the same KV dtype, "
                    "block size and pool layout"
                )

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, obj: object) -> KVLayout:
        d = exact_keys("layout", obj, [f.name for f in fields(cls)])
        return cls(**d)


@dataclass(frozen=True)
class PeerId:
    """One process lifetime of a worker: a restart at the same address is a new instance.

    `instance_id` is random, 64-bit and non-zero, drawn once per process start
    (`process_instance_id`); a message from another instance than the one a transfer was set up
    with is never trusted.
    """

    instance_id: int
    host: str
    port: int

    def __post_init__(self) -> None:
        require_int("PeerId.instance_id", self.instance_id, 1, U64)
        require_str("PeerId.host", self.host)
        if any(c.isspace() for c in self.host):
            raise ValueError(f"PeerId.host must not contain whitespace, got {self.host!r}")
        require_int("PeerId.port", self.port, 1, 65536)

    @classmethod
    def local(cls, host: str, port: int) -> PeerId:
        """This process, reachable at host:port."""
        return cls(process_instance_id(), host, port)

    def same_address(self, other: PeerId) -> bool:
        """Same host and port; with another instance id that is a restarted, stale peer."""
        return (self.host, self.port) == (other.host, other.port)

    def to_json(self) -> dict[str, Any]:
        return {"instance_id": hex64(self.instance_id), "host": self.host, "port": self.port}

    @classmethod
    def from_json(cls, obj: object) -> PeerId:
        d = exact_keys("peer", obj, ["instance_id", "host", "port"])
        return cls(parse_hex64("peer.instance_id", d["instance_id"]), d["host"], d["port"])


# -- messages ------------------------------------------------------------------------------------


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
        self._check_layers()
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

    def _check_layers(self) -> None:
        require_int("layer_begin", self.layer_begin, 0, self.layout.num_layers)
        require_int("layer_end", self.layer_end, self.layer_begin + 1,
                     self.layout.num_layers + 1)

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


def decode_message(data: bytes | bytearray | memoryview) -> TransferDescriptor | CompletionNotice:
    """Decode any transfer-plane message by the kind in its frame."""
    if len(data) >= FRAME.size and bytes(data[6:7]) == bytes([KIND_NOTICE]):
        return CompletionNotice.decode(data)
    return TransferDescriptor.decode(data)
