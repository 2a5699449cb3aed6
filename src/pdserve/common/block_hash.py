"""Chained block hashes for prefix caching.

A full block's hash covers its own tokens and, through the parent hash, every token before it,
so two requests share a block only when their whole prefixes match. The router computes the
same hashes for prefix-aware routing, so the function is deterministic across processes
(blake2b, not Python's salted `hash`). Collisions are harmless: the block manager also compares
the tokens before it shares a block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """64-bit hash of one full block, chained on its parent's hash (ROOT_HASH for the first)."""
    h = hashlib.blake2b(parent_hash.to_bytes(8, "little"), digest_size=8)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def hash_blocks(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Hashes of every full block of `token_ids`, in order (a partial tail block has none)."""
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
