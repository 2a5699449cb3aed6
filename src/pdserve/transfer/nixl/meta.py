"""What two NIXL endpoints exchange before they can move blocks, and the pool's NIXL layout.

Each endpoint sends every peer instance it talks to one metadata message over the TCP control
channel (`transport.py` filters these out of `receive`, so the session layer never sees them):

    MAGIC (8 bytes) | u32 LE header length | JSON header | NIXL agent metadata

The JSON header names the agent and describes the pool as one strided region (`PoolRegion`):
memory type, device, base address, block stride, block size and block count. The receiver
builds its per-block descriptor list from that region (one descriptor per block, index =
block id), which keeps the message a few KiB whatever the pool size; the agent metadata
(UCX addresses and remote keys) comes from `get_agent_metadata()` after registration.

Invariant: a region is only sent once the pool is registered with the agent, so the agent
metadata in the same message carries the keys for every block it describes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pdserve.transfer.peer import PeerId

if TYPE_CHECKING:
    from pdserve.engine.kv_cache import KVCache

MAGIC = b"\x00PDNIXL\x01"
_LEN = struct.Struct("<I")


def agent_name(peer: PeerId) -> str:
    """The NIXL agent name of one endpoint instance: a restarted peer is a different agent."""
    return f"pdserve-{peer.instance_id:016x}-{peer.host}-{peer.port}"


@dataclass(frozen=True)
class PoolRegion:
    """A KV pool as NIXL sees it: block b is `[base + b * stride, + block_nbytes)`.

    Invariants: `stride >= block_nbytes > 0`, `num_blocks >= 1`, `mem` is "DRAM" (CPU) or
    "VRAM" (CUDA, `device` = the CUDA ordinal); a block holds `num_layers` contiguous layer
    slices of `block_nbytes / num_layers` bytes each."""

    mem: str
    device: int
    base: int
    stride: int
    block_nbytes: int
    num_blocks: int
    num_layers: int = 1

    @classmethod
    def of_cache(cls, cache: KVCache) -> PoolRegion:
        data = cache.data
        if not data[0].is_contiguous():
            raise ValueError("NIXL moves pools whose blocks are contiguous regions")
        cuda = data.device.type == "cuda"
        return cls("VRAM" if cuda else "DRAM", (data.device.index or 0) if cuda else 0,
                   data.data_ptr(), data.stride(0) * data.element_size(), cache.block_nbytes,
                   data.shape[0], data.shape[1])

    @property
    def span(self) -> int:
        """Bytes from the first block's start to the last block's end."""
        return (self.num_blocks - 1) * self.stride + self.block_nbytes

    def reg_list(self) -> list[tuple[int, int, int, str]]:
        """The one region to register with the agent."""
        return [(self.base, self.span, self.device, "")]

    def block_descs(self) -> list[tuple[int, int, int]]:
        """One transfer descriptor per block, in block-id order."""
        return [(self.base + b * self.stride, self.block_nbytes, self.device)
                for b in range(self.num_blocks)]

    def layer_descs(self, ids: Sequence[int], first: int, end: int
                    ) -> list[tuple[int, int, int]]:
        """One descriptor per block of `ids`: its slices of layers [first, end)."""
        if not 0 <= first < end <= self.num_layers:
            raise ValueError(f"layers [{first}, {end}) outside the pool's {self.num_layers}")
        size = self.block_nbytes // self.num_layers
        return [(self.base + b * self.stride + first * size, (end - first) * size, self.device)
                for b in ids]

    def check(self, ids: list[int] | tuple[int, ...], what: str) -> None:
        """Raise ValueError unless ids are distinct, in range and at least one."""
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"{what}: block ids must be distinct and at least one")
        if any(type(b) is not int for b in ids) or min(ids) < 0 or max(ids) >= self.num_blocks:
            raise ValueError(f"{what}: block ids must be integers in [0, {self.num_blocks})")


def is_meta(message: bytes) -> bool:
    return message[: len(MAGIC)] == MAGIC


def encode_meta(name: str, region: PoolRegion, agent_md: bytes) -> bytes:
    header = json.dumps({"agent": name, "region": asdict(region)}).encode()
    return MAGIC + _LEN.pack(len(header)) + header + agent_md


def decode_meta(message: bytes) -> tuple[str, PoolRegion, bytes]:
    """(agent name, region, agent metadata); ValueError if malformed."""
    start = len(MAGIC) + _LEN.size
    if not is_meta(message) or len(message) < start:
        raise ValueError("not a NIXL metadata message")
    (hlen,) = _LEN.unpack_from(message, len(MAGIC))
    try:
        header = json.loads(message[start : start + hlen])
        region = PoolRegion(**header["region"])
        name = header["agent"]
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"bad NIXL metadata header: {e}") from None
    if not (isinstance(name, str) and region.num_blocks >= 1
            and region.stride >= region.block_nbytes > 0 and region.mem in ("DRAM", "VRAM")):
        raise ValueError("bad NIXL metadata header values")
    return name, region, message[start + hlen :]
