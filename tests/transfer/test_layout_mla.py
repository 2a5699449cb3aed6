"""The latent (MLA) pool's KVLayout, and the transfer plane moving its blocks unchanged."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.model_config import ModelConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.router.split_decision import kv_bytes_per_token
from pdserve.transfer.checksum import slices_crc32c
from pdserve.transfer.layout import LAYOUT_PAGED_KV, LAYOUT_PAGED_MLA, KVLayout
from tests.transfer.test_tcp import endpoint, finish

# DeepSeek-V3's attention widths on 3 layers: latent 512 + rotary key 64 per token and layer
DEEPSEEK = ModelConfig.from_hf_dict({
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
    "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "kv_lora_rank": 512, "q_lora_rank": 96, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "first_k_dense_replace": 3, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
})


def _pool(num_blocks: int, seed: int | None = None) -> KVCache:
    cache = KVCache(DEEPSEEK, num_blocks, 16, torch.float32)
    if seed is not None:
        cache.data.copy_(torch.randn(cache.data.shape,
                                     generator=torch.Generator().manual_seed(seed)))
    return cache


def test_layout_of_a_latent_pool():
    layout = KVLayout.of_cache(_pool(2), "deepseek")
    assert (layout.layout, layout.kv_heads, layout.head_dim) == (LAYOUT_PAGED_MLA, 1, 576)
    assert layout.slice_shape == (1, 16, 1, 576)
    assert layout.slice_nbytes == 16 * 576 * 4
    assert layout.bytes_per_token == 3 * 576 * 4 == DEEPSEEK.kv_bytes_per_token(4)
    assert kv_bytes_per_token(layout.to_json()) == layout.bytes_per_token
    assert KVLayout.from_json(layout.to_json()) == layout


def test_a_latent_and_a_per_head_pool_of_equal_sizes_are_incompatible_by_layout():
    mla = KVLayout("m", "bfloat16", 16, 3, 1, 576, LAYOUT_PAGED_MLA)
    gqa = KVLayout("m", "bfloat16", 16, 3, 1, 576, LAYOUT_PAGED_KV)
    with pytest.raises(ValueError, match="incompatible KV layout: layout is "):
        mla.check_compatible(gqa)
    assert kv_bytes_per_token(gqa.to_json()) == 2 * kv_bytes_per_token(mla.to_json())


def test_a_latent_layout_has_one_row_per_token():
    with pytest.raises(ValueError, match="kv_heads must be 1 for paged_mla"):
        KVLayout("m", "bfloat16", 16, 3, 2, 576, LAYOUT_PAGED_MLA)


def test_tcp_moves_latent_blocks_and_layer_slices_unchanged():
    src, dst = _pool(8, seed=3), _pool(8)
    with endpoint(src) as a, endpoint(dst) as b:
        b.allow_writes(1, a.local, [0, 7])
        b.allow_writes(2, a.local, [3], layers=range(1, 2))
        assert finish(a, a.write(1, [5, 2], b.local, [0, 7])) == "done"
        assert finish(a, a.write(2, [4], b.local, [3], layers=range(1, 2))) == "done"
    assert torch.equal(dst.data[[0, 7]], src.data[[5, 2]])
    assert torch.equal(dst.data[3, 1], src.data[4, 1])
    assert not dst.data[3, [0, 2]].any()
    assert slices_crc32c(dst.data, [0, 7], range(3)) == slices_crc32c(src.data, [5, 2], range(3))
