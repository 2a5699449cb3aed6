"""Block manager invariants: ref counts, prefix sharing, token equality, generations."""

from __future__ import annotations

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine import block_manager as bm_module
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request

BS = 4


def _req(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, list(tokens), len(tokens), SamplingParams())


def _computed(bm: BlockManager, req: Request) -> Request:
    """Pretend the model ran every token of the request, and register its full blocks."""
    req.num_computed_tokens = req.num_tokens
    bm.commit_computed(req)
    return req


def _allocated(bm: BlockManager, tokens, rid: str) -> Request:
    req = _req(tokens, rid)
    bm.allocate(req)
    return _computed(bm, req)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = _req(range(10))
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.block_ids) == 3 and bm.num_free_blocks == 5
    bm.free(a)
    assert bm.num_free_blocks == 8 and a.block_ids == []


def test_can_allocate_refuses_what_does_not_fit():
    bm = BlockManager(2, BS, enable_prefix_caching=False)
    assert not bm.can_allocate(_req(range(9)))  # 3 blocks
    with pytest.raises(RuntimeError):
        bm.allocate(_req(range(9)))
    assert bm.num_free_blocks == 2


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = _allocated(bm, range(10), "a")
    b = _req([*range(8), 99, 98, 97], "b")
    hits = bm.match_prefix(b.token_ids)
    assert hits == a.block_ids[:2]
    bm.allocate(b)
    assert b.num_computed_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert [bm.blocks[i].ref_count for i in a.block_ids[:2]] == [2, 2]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_ids[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_freed_cached_blocks_are_revived_until_reused():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = _allocated(bm, range(9), "a")  # 2 full blocks + 1 partial
    gens = [bm.generation(i) for i in a.block_ids]
    bm.free(a)
    b = _req(range(9), "b")
    bm.allocate(b)
    assert b.num_computed_tokens == 8
    assert [bm.generation(i) for i in b.block_ids[:2]] == gens[:2]  # shared, not reallocated
    bm.free(b)
    c = _allocated(bm, range(100, 116), "c")  # needs all 4 blocks: evicts the cached ones
    assert sorted(c.block_ids) == [0, 1, 2, 3]
    bm.free(c)
    assert bm.match_prefix(list(range(9))) == []


def test_partial_and_uncached_blocks_are_reused_before_cached_ones():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = _allocated(bm, range(6), "a")  # one full (cached) block, one partial
    full, partial = a.block_ids
    bm.free(a)
    b = _req(range(50, 53), "b")
    bm.allocate(b)
    assert b.block_ids == [partial]
    assert bm.match_prefix(list(range(6))) == [full]


def test_every_allocation_bumps_the_generation():
    bm = BlockManager(1, BS, enable_prefix_caching=False)
    seen = []
    for i in range(3):
        r = _req([i, i], f"r{i}")
        bm.allocate(r)
        seen.append(bm.generation(r.block_ids[0]))
        bm.free(r)
    assert seen == [1, 2, 3]


def test_hash_collision_never_shares_different_tokens(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 42)
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    _allocated(bm, [1, 2, 3, 4, 5], "a")
    b = _req([9, 9, 9, 9, 9], "b")
    assert bm.match_prefix(b.token_ids) == []
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_append_takes_a_block_only_when_the_last_is_full():
    bm = BlockManager(3, BS, enable_prefix_caching=False)
    r = _req(range(4))
    bm.allocate(r)
    r.num_computed_tokens = 4
    r.token_ids.append(7)  # a sampled token at position 4 needs block 2
    assert bm.can_append(r)
    bm.append(r)
    assert len(r.block_ids) == 2
    r.token_ids.append(8)
    bm.append(r)
    assert len(r.block_ids) == 2
    bm.free(r)
    assert bm.num_free_blocks == 3


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    _allocated(bm, range(9), "a")
    assert bm.match_prefix(list(range(9))) == []
