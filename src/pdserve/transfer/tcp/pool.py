"""The pool a TCP endpoint moves blocks of, and the permits that guard it.

`BlockPool` gives byte views of a registered CPU pool (no copies). `PoolGate` is what both
sides of the endpoint consult before they touch the pool for a peer: the registered pool
(None until `register`) and the `Permits` the sessions grant, with the refusal logging, and
the fence of `revoke`: a frame that lands in or goes out of the pool for a peer does so
inside `use`, on its connection's socket, and `revoke` waits for those of its transfer to end
(up to `wait_s`, then it shuts their sockets down).
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, cast

import torch

from pdserve.throttled_log import ThrottledLog
from pdserve.transfer.peer import PeerId
from pdserve.transfer.permits import Kind, Permits, Refusal
from pdserve.transfer.tcp.frames import ProtocolError, shut

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

    def __init__(self, throttled: ThrottledLog, wait_s: float) -> None:
        self.pool: BlockPool | None = None
        self.permits = Permits()
        self._throttled, self._wait_s = throttled, wait_s

    def register(self, cache: KVCache) -> None:
        self.pool = BlockPool(cache)

    def revoke(self, tid: int) -> None:
        """End the permits of transfer `tid`; once this returns none of its frames touches
        the pool (one still landing or going out after `wait_s` has its connection shut
        down, which stops it at once)."""
        stuck = self.permits.revoke(tid, self._wait_s)
        if not stuck:
            return
        log.warning("transfer %x: a frame still moving %.1f s after its permit ended; "
                    "dropping its connection", tid, self._wait_s)
        for sock in stuck:
            shut(cast(socket.socket, sock))
        if self.permits.revoke(tid, self._wait_s):
            log.error("transfer %x: a frame still moving after its connection was shut", tid)

    @contextlib.contextmanager
    def use(self, kind: Kind, peer: PeerId, tid: int, ids: Sequence[int],
            layers: tuple[int, int] | None, sock: socket.socket) -> Iterator[str | None]:
        """Inside: None when `peer` holds a permit for this frame, which then moves on `sock`
        before `revoke(tid)` can return; else the reason (`refusal`)."""
        pool = self.pool
        assert pool is not None
        span = layers or (0, pool.num_layers)
        refusal = self.permits.use(kind, tid, peer, ids, span, sock)
        if refusal is not None:
            yield self._refused(kind, peer, refusal)
            return
        try:
            yield None
        finally:
            self.permits.done(tid, sock)

    def refusal(self, kind: Kind, peer: PeerId, tid: int, ids: Sequence[int],
                layers: tuple[int, int] | None) -> str | None:
        """None when `peer` holds a permit for this move; else the reason, logged: a warning
        (rate-limited) for a stray, a debug line for a late move of the permit's own peer.
        Only with a registered pool."""
        pool = self.pool
        assert pool is not None
        refusal = self.permits.refusal(kind, tid, peer, ids, layers or (0, pool.num_layers))
        return None if refusal is None else self._refused(kind, peer, refusal)

    def _refused(self, kind: Kind, peer: PeerId, refusal: Refusal) -> str:
        if refusal.late:
            log.debug("dropped a late %s from %s: %s", kind, peer, refusal.reason)
        else:
            self._throttled.warn(kind, "refused a %s from %s: %s", kind, peer, refusal.reason)
        return refusal.reason
