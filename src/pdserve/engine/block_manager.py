"""Physical KV blocks: free list, reference counts, prefix cache, generation ids.

Invariants:
- A block is in the free list exactly when its ref count is 0. Free blocks that still carry a
  prefix hash keep their contents and can be revived by a prefix hit until they are reused.
- The free list is in eviction order: blocks without a hash first, then cached blocks from
  least to most recently freed. Allocation takes from the front.
- Every allocation of a block from the free list bumps its generation id, so anyone holding
  (block_id, generation) can tell that the slot was since given to someone else. A prefix hit
  shares a block; it is not a new allocation and keeps the generation.
- A hash maps to one block, and only blocks whose tokens are fully computed are hashed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pdserve.common.block_hash import ROOT_HASH, hash_block
from pdserve.engine.request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    generation: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()  # the tokens behind `hash`, for the equality check


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def generation(self, block_id: int) -> int:
        return self.blocks[block_id].generation

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached blocks holding the longest computed prefix of `token_ids`.

        At most (len - 1) tokens are matched: the last prompt token is always computed, since
        its logits give the next token.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = ROOT_HASH
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            chunk = token_ids[start : start + bs]
            parent = hash_block(parent, chunk)
            block_id = self._cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tuple(chunk):
                break
            hits.append(block_id)
        return hits

    # -- allocation ---------------------------------------------------------------------------

    def can_allocate(self, req: Request, use_prefix_cache: bool = True) -> bool:
        """Whether `allocate` would find blocks for all of the request's tokens."""
        hits = self.match_prefix(req.token_ids) if use_prefix_cache else []
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        fresh = self.blocks_needed(req.num_tokens) - len(hits)
        return fresh + revived <= self.num_free_blocks

    def allocate(self, req: Request, use_prefix_cache: bool = True) -> None:
        """Give a request without blocks blocks for all its tokens, sharing its cached prefix.

        Sets `num_computed_tokens` to the number of tokens whose KV the shared blocks hold.
        """
        if req.block_ids:
            raise RuntimeError(f"request {req.request_id} already holds blocks")
        if not self.can_allocate(req, use_prefix_cache):
            raise RuntimeError("allocate() without room; call can_allocate() first")
        hits = self.match_prefix(req.token_ids) if use_prefix_cache else []
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            req.block_hashes.append(block.hash)  # type: ignore[arg-type]
        req.block_ids = hits + [self._take_free() for _ in range(
            self.blocks_needed(req.num_tokens) - len(hits))]
        req.num_computed_tokens = len(hits) * self.block_size
        req.num_cached_tokens = req.num_computed_tokens

    def can_append(self, req: Request) -> bool:
        """Whether the request's newest token has a slot (or one free block would give it)."""
        return not self._needs_block(req) or self.num_free_blocks > 0

    def append(self, req: Request) -> None:
        """Give the request's newest token a slot, taking one block if its last is full."""
        if self._needs_block(req):
            req.block_ids.append(self._take_free())

    def free(self, req: Request) -> None:
        """Drop the request's hold on its blocks; tail blocks become the first to be evicted."""
        for block_id in reversed(req.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:
                    self._free.move_to_end(block_id, last=False)
        req.block_ids = []
        req.block_hashes = []

    def commit_computed(self, req: Request) -> None:
        """Register every newly full, computed block of the request in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(req.block_hashes), req.num_computed_tokens // bs):
            parent = req.block_hashes[-1] if req.block_hashes else ROOT_HASH
            tokens = tuple(req.token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, tokens)
            req.block_hashes.append(h)
            block = self.blocks[req.block_ids[i]]
            if h not in self._cached and block.hash is None:
                block.hash, block.token_ids = h, tokens
                self._cached[h] = block.block_id

    # -- internals ----------------------------------------------------------------------------

    def _needs_block(self, req: Request) -> bool:
        return len(req.block_ids) * self.block_size < req.num_tokens

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its prefix-cache entry: the contents are overwritten
            del self._cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        block.generation += 1
        return block_id
