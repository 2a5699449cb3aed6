"""The pool a TCP endpoint moves blocks of, and the permits that guard it.

`BlockPool` gives byte views of a registered CPU pool (no copies). `PoolGate` is what both
sides of the endpoint consult before they touch the pool for a peer: the registered pool
(None until `register`) and the `Permits` the sessions grant, with the refusal logging.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.throttled_log import ThrottledLog
from pdserve.transfer.peer import PeerId
from pdserve.transfer.permits import Kind, Permits
from pdserve.transfer.tcp.frames import ProtocolError

if TYPE_CHECKING:
    from pdserve.engine.kv_cache import KVCache

log = logging.getLogger(__name__)


class BlockPool:
    """Byte views of a registered CPU `KVCache`: block b is `data[b]`, one contiguous region of
    `block_nbytes` bytes. Views alias the pool's memory (no copies) for the pool's lifetime."""

    def __init__(self, cache: KVCache) -> None:
        data = cache.data
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError("the TCP transport moves contiguous CPU pools only")
        self.num_blocks, self.num_layers = data.shape[0], data.shape[1]
        self.block_nbytes = cache.block_nbytes
        self.layer_nbytes = self.block_nbytes // self.num_layers
        self._bytes = data.view(torch.uint8).reshape(self.num_blocks, -1).numpy()

    def check(self, ids: Sequence[int], what: str) -> None:
        """Raise ProtocolError unless ids are distinct, in range and at least one."""
        if not ids or len(set(ids)) != len(ids):
            raise ProtocolError(f"{what}: block ids must be distinct and at least one")
        if min(ids) < 0 or max(ids) >= self.num_blocks:
            raise ProtocolError(f"{what}: block id out of the pool's [0, {self.num_blocks})")

    def view(self, block: int, layers: tuple[int, int] | None = None) -> memoryview:
        """Block `block`, or only its slices of layers [first, end)."""
        if layers is None:
            return memoryview(self._bytes[block])
        first, end = layers
        return memoryview(self._bytes[block, first * self.layer_nbytes : end * self.layer_nbytes])

    def check_layers(self, first: int, end: int) -> None:
        if not 0 <= first < end <= self.num_layers:
            raise ProtocolError(f"layers [{first}, {end}) outside the pool's {self.num_layers}")


class PoolGate:
    """The registered pool (None until `register`; replaced by a later `register`) and the
    permits for the moves peers start. Thread-safe (`Permits` locks; the pool is swapped
    whole). Lifetime: the endpoint's."""

    def __init__(self, throttled: ThrottledLog) -> None:
        self.pool: BlockPool | None = None
        self.permits = Permits()
        self._throttled = throttled

    def register(self, cache: KVCache) -> None:
        self.pool = BlockPool(cache)

    def refusal(self, kind: Kind, peer: PeerId, tid: int, ids: Sequence[int],
                layers: tuple[int, int] | None) -> str | None:
        """None when `peer` holds a permit for this move; else the reason, logged: a warning
        (rate-limited) for a stray, a debug line for a late move of the permit's own peer.
        Only with a registered pool."""
        pool = self.pool
        assert pool is not None
        refusal = self.permits.refusal(kind, tid, peer, ids, layers or (0, pool.num_layers))
        if refusal is None:
            return None
        if refusal.late:
            log.debug("dropped a late %s from %s: %s", kind, peer, refusal.reason)
        else:
            self._throttled.warn(kind, "refused a %s from %s: %s", kind, peer, refusal.reason)
        return refusal.reason
