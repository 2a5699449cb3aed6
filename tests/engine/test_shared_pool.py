"""The KV pool a CPU tensor-parallel engine's ranks share: every rank maps one memory file, each
computes over its own heads' rows of every slot, and the pool stays a whole model's pool for
the transfer plane."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from pdserve.common.model_config import ModelConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.parallel.shared_pool import SharedPool, shmem_huge_pages

BF16 = torch.bfloat16


def _pool(gen: torch.Generator, kvh: int, d: int, bs: int = 16, blocks: int = 12
          ) -> torch.Tensor:
    """[blocks, layers=3, 2, bs, kvh, d] bf16, the engine's layout, random."""
    return torch.randn(blocks, 3, 2, bs, kvh, d, generator=gen).to(BF16)


def _views(data: torch.Tensor, heads: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 1's K and V, narrowed to `heads`: strided slots, as a rank sees them."""
    return data[:, 1, 0, :, heads], data[:, 1, 1, :, heads]


@pytest.mark.parametrize(("kvh", "heads"), [(3, slice(1, 3)), (3, slice(0, 1)), (4, slice(2, 4))])
def test_the_operators_read_and_write_a_ranks_heads_of_a_wider_pool_exactly(ops, kvh, heads):
    """The KV store and decode attention give, over a rank's heads of the whole pool, the bits
    they give over a pool holding only those heads; the other heads' rows are never touched
    (prefill attention: the next test, where the CPU runs it)."""
    gen = torch.Generator().manual_seed(kvh)
    d, g, n = 64, 3, 5
    wide = _pool(gen, kvh, d)
    alone = wide[:, :, :, :, heads].contiguous()
    own = heads.stop - heads.start
    others = wide.clone()
    k = torch.randn(n, own, d, generator=gen).to(BF16)
    v = torch.randn(n, own, d, generator=gen).to(BF16)
    blocks, offsets = torch.tensor([4, 4, 0, 7, 2]), torch.tensor([0, 15, 3, 7, 7])
    ops.store_kv_(k, v, *_views(wide, heads), blocks, offsets)
    ops.store_kv_(k, v, *_views(alone, slice(None)), blocks, offsets)
    assert torch.equal(wide[:, :, :, :, heads], alone)
    rest = [h for h in range(kvh) if not heads.start <= h < heads.stop]
    assert torch.equal(wide[..., rest, :], others[..., rest, :])

    tables = torch.randperm(12, generator=gen)[:8].view(2, 4)
    lens = torch.tensor([17, 64])
    q = torch.randn(2, own * g, d, generator=gen).to(BF16)
    assert torch.equal(ops.decode_attention(q, *_views(wide, heads), tables, lens, 0.125),
                       ops.decode_attention(q, *_views(alone, slice(None)), tables, lens, 0.125))


@pytest.mark.parametrize(("kvh", "heads"), [(3, slice(1, 3)), (3, slice(0, 1)), (4, slice(2, 4))])
def test_prefill_attention_reads_a_ranks_heads_of_a_wider_pool_exactly(flash, kvh, heads):
    gen = torch.Generator().manual_seed(kvh)
    d, g = 64, 3
    wide = _pool(gen, kvh, d)
    alone = wide[:, :, :, :, heads].contiguous()
    qp = torch.randn(40, (heads.stop - heads.start) * g, d, generator=gen).to(BF16)
    table = torch.randperm(12, generator=gen)[:8]
    assert torch.equal(
        flash.prefill_attention(qp, *_views(wide, heads), table, 50, 0.125),
        flash.prefill_attention(qp, *_views(alone, slice(None)), table, 50, 0.125))


def test_a_slot_narrower_than_the_view_is_refused(ops):
    data = torch.zeros(4, 1, 2, 16, 2, 64, dtype=BF16)
    k = data[:, 0, 0].transpose(1, 2)  # heads outermost: a slot's rows are not together
    with pytest.raises(RuntimeError, match="each slot's heads contiguous"):
        ops.store_kv_(torch.zeros(1, 16, 64, dtype=BF16), torch.zeros(1, 16, 64, dtype=BF16),
                      k, k, torch.tensor([0]), torch.tensor([0]))


def _child_writes(pool: SharedPool, shape: tuple[int, ...]) -> None:
    data = pool.tensor(shape, torch.float32)
    data[1, 0].fill_(7.0)  # block 1, layer 0
    pool.close()


def test_a_spawned_rank_writes_what_rank_zero_reads():
    shape = (3, 2, 2, 4, 2, 8)
    pool = SharedPool(3 * 2 * 2 * 4 * 2 * 8 * 4)
    data = pool.tensor(shape, torch.float32)
    assert not data.any()
    child = mp.get_context("spawn").Process(target=_child_writes, args=(pool, shape))
    child.start()
    pool.close()
    child.join(60)
    assert child.exitcode == 0
    assert torch.equal(data[1, 0], torch.full((2, 4, 2, 8), 7.0))
    assert not data[0].any() and not data[2].any() and not data[1, 1].any()


def test_a_pool_of_the_wrong_size_or_closed_is_refused():
    pool = SharedPool(64)
    with pytest.raises(ValueError, match=r"a \[4, 8\] torch.float32 pool is 128 bytes; this one "
                                         r"is 64"):
        pool.tensor((4, 8), torch.float32)
    pool.close()
    with pytest.raises(ValueError, match="descriptor was closed"):
        pool.tensor((4, 4), torch.float32)
    with pytest.raises(ValueError, match="positive size"):
        SharedPool(0)


def test_a_ranks_cache_keeps_the_whole_pool_and_computes_over_its_heads():
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64,
                      intermediate_size=32, num_layers=2, num_heads=6, num_kv_heads=3,
                      head_dim=16, max_position_embeddings=64)
    shape = KVCache.shape(cfg, 5, 4)
    assert shape == (5, 2, 2, 4, 3, 16)
    data = torch.zeros(shape)
    cache = KVCache(cfg, 5, 4, torch.float32, pool=data, heads=range(1, 3))
    assert cache.data is data
    k, v = cache.layers[1]
    assert k.shape == v.shape == (5, 4, 2, 16)
    k.fill_(1.0)
    assert torch.equal(data[:, 1, 0, :, 1:].flatten().unique(), torch.tensor([1.0]))
    assert not data[:, 1, 0, :, 0].any() and not data[:, 1, 1].any() and not data[:, 0].any()
    with pytest.raises(ValueError, match=r"the pool given is \[5, 2, 2, 4, 3, 8\]"):
        KVCache(cfg, 5, 4, torch.float32, pool=torch.zeros(5, 2, 2, 4, 3, 8))


def test_the_shmem_huge_page_setting_is_read_from_its_brackets():
    assert not shmem_huge_pages("always within_size advise [never] deny force\n")
    assert not shmem_huge_pages("always within_size advise never [deny] force")
    assert shmem_huge_pages("always within_size [advise] never deny force")
    assert shmem_huge_pages("[always] within_size advise never deny force")
    assert shmem_huge_pages(None)
