"""MLA's configuration, YaRN tables, rotary and latent pool: what the DeepSeek decoders rely
on."""

from __future__ import annotations

import math
import re

import pytest
import torch

from pdserve.common.mla_config import MlaConfig
from pdserve.common.model_config import ModelConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model import yarn
from pdserve.engine.model.mla_rope import MlaRotary

BASE = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 512, "hidden_size": 48,
        "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 3,
        "kv_lora_rank": 24, "q_lora_rank": 20, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8,
        "v_head_dim": 10, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
        "topk_group": 1, "max_position_embeddings": 1024, "rope_theta": 5000.0}
YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}


def test_mla_config_reads_deepseek_fields_and_v2_lite_has_no_q_lora():
    cfg = ModelConfig.from_hf_dict(BASE)
    assert cfg.mla == MlaConfig(20, 24, 12, 8, 10, rope_interleave=True)
    assert cfg.head_dim == 20 and cfg.mla.latent_dim == 32
    lite = ModelConfig.from_hf_dict({**BASE, "architectures": ["DeepseekV2ForCausalLM"],
                                     "q_lora_rank": None, "rope_interleave": False,
                                     "n_group": None, "topk_group": None})
    assert lite.mla.q_lora_rank is None
    assert lite.mla.rope_interleave  # transformers' V2 always pairs adjacent values


@pytest.mark.parametrize(("field", "value", "message"), [
    ("kv_lora_rank", None, "missing MLA field(s): kv_lora_rank"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim must be even"),
    ("v_head_dim", 0, "v_head_dim must be a positive integer"),
    ("q_lora_rank", 1.5, "q_lora_rank must be an integer"),
])
def test_bad_mla_fields_name_the_config_field(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_hf_dict({**BASE, field: value})


def test_rope_types_yarn_for_deepseek_only_and_unknown_types_refused():
    assert ModelConfig.from_hf_dict({**BASE, "rope_scaling": YARN}).rope_scaling == YARN
    with pytest.raises(ValueError, match="rope_scaling type 'longrope' is not supported for "
                                         "DeepseekV3ForCausalLM; supported: default, yarn"):
        ModelConfig.from_hf_dict({**BASE, "rope_scaling": {"type": "longrope", "factor": 2}})
    llama = {k: BASE[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                  "num_hidden_layers", "num_attention_heads")}
    with pytest.raises(ValueError, match="'yarn' is not supported for LlamaForCausalLM"):
        ModelConfig.from_hf_dict({**llama, "architectures": ["LlamaForCausalLM"],
                                  "rope_scaling": YARN})
    with pytest.raises(ValueError, match="needs a numeric 'factor'"):
        ModelConfig.from_hf_dict({**BASE, "rope_scaling": {"type": "yarn"}})


@pytest.mark.parametrize("scaling", [None, YARN, {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}])
def test_yarn_tables_and_scale_equal_transformers(scaling):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    fields = {k: v for k, v in BASE.items() if k != "architectures"}
    hf = DeepseekV3Config(**fields, rope_scaling=scaling)
    ours = ModelConfig.from_hf_dict({**BASE, "rope_scaling": scaling})
    inv_freq, factor = yarn.inv_frequencies(ours)
    if scaling is None:
        ref_freq, ref_factor = DeepseekV3RotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    assert torch.equal(inv_freq, ref_freq) and factor == ref_factor
    assert yarn.softmax_scale(ours) == DeepseekV3Attention(hf, 0).scaling
    if scaling is YARN:  # mscale 0.707 over 1.0: cos/sin and the logits are both scaled
        assert factor != 1.0 and yarn.softmax_scale(ours) != 20 ** -0.5
        assert math.isclose(yarn.softmax_scale(ours),
                            20 ** -0.5 * (0.1 * math.log(40.0) + 1) ** 2)


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"])
@pytest.mark.parametrize("interleave", [True, False])
def test_the_operators_rotate_in_place_as_pytorch_does_in_fp32(ops, arch, interleave):
    """`mla_rope_` on strided views (q's rotary columns, as the model rotates them) equals the
    PyTorch rotation computed in fp32 and rounded once, for both pair layouts (to one bf16
    step: the compiler may fuse a product and a sum into one FMA)."""
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": [arch], "rope_scaling": YARN,
                                    "rope_interleave": interleave})
    positions = torch.tensor([0, 5, 63, 700])
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(4, 3, 12 + 8, generator=gen).bfloat16()  # [T, H, d_n + d_r]
    expected = MlaRotary(cfg, 1024, "cpu").for_step(positions, torch.float32).rotate(
        q[..., 12:].float()).bfloat16()
    step = MlaRotary(cfg, 1024, "cpu", ops).for_step(positions, torch.bfloat16)
    nope = q[..., :12].clone()
    assert step.rotate(q[..., 12:]).data_ptr() == q[..., 12:].data_ptr()  # in place
    torch.testing.assert_close(q[..., 12:], expected, rtol=2**-8, atol=1e-6)
    assert torch.equal(q[..., :12], nope)
    with pytest.raises(RuntimeError, match=r"cos and sin must be contiguous fp32 \[3, 4\]"):
        step.rotate(q[:3, :, 12:])


@pytest.mark.parametrize("interleave", [True, False])
def test_the_operators_store_the_latent_rows_as_norm_rotate_and_copy_do(ops, interleave):
    """`mla_store_`: each token's [norm(c) ; rotated k_rope] in its slot, bit for bit what
    `rms_norm` and `mla_rope_` give, from strided rows; other slots untouched; bad slots and
    shapes refused with the reason."""
    cfg = ModelConfig.from_hf_dict({**BASE, "rope_scaling": YARN, "rope_interleave": interleave})
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(4, 40, generator=gen).bfloat16()[:, :32]  # [T, r + d_r], rows 40 apart
    weight = torch.randn(24, generator=gen).bfloat16()
    step = MlaRotary(cfg, 1024, "cpu", ops).for_step(torch.tensor([0, 5, 63, 700]),
                                                     torch.bfloat16)
    cache = torch.randn(3, 4, 32, generator=gen).bfloat16()  # [blocks, block_size, latent]
    before = cache.clone()
    blocks, offsets = torch.tensor([2, 0, 2, 1]), torch.tensor([3, 1, 0, 3])
    ops.mla_store_(kv, weight, 1e-6, step.cos, step.sin, interleave, cache, blocks, offsets)
    rope = kv[:, 24:].clone()[:, None, :]
    ops.mla_rope_(rope, step.cos, step.sin, interleave)
    expected = torch.cat([ops.rms_norm(kv[:, :24].contiguous(), weight, 1e-6), rope[:, 0]], 1)
    assert torch.equal(cache[blocks, offsets], expected)
    cache[blocks, offsets] = before[blocks, offsets]
    assert torch.equal(cache, before)
    with pytest.raises(RuntimeError, match=r"slot \(block 3, offset 0\) is outside the pool"):
        ops.mla_store_(kv, weight, 1e-6, step.cos, step.sin, interleave, cache,
                       torch.tensor([2, 0, 3, 1]), offsets)
    with pytest.raises(RuntimeError, match=r"kv must be bf16 \[T, 32\]"):
        ops.mla_store_(kv[:, :30], weight, 1e-6, step.cos, step.sin, interleave, cache,
                       blocks, offsets)


def test_latent_pool_is_one_row_per_token_per_layer_in_contiguous_blocks():
    cfg = ModelConfig.from_hf_dict(BASE)
    cache = KVCache(cfg, num_blocks=5, block_size=16, dtype=torch.float32)
    assert cache.is_latent
    assert cache.data.shape == (5, 2, 1, 16, 1, 32) and cache.data.is_contiguous()
    assert cache.block_nbytes == 16 * cfg.kv_bytes_per_token(4) == 16 * 2 * 32 * 4
    (latent,) = cache.layers[1]  # [num_blocks, block_size, latent]
    assert latent.shape == (5, 16, 32)
    latent[3, 7] = torch.arange(32.0)
    assert torch.equal(cache.block(3)[1, 0, 7, 0], torch.arange(32.0))
    src = KVCache(cfg, num_blocks=5, block_size=16, dtype=torch.float32)
    src.data.normal_()
    cache.copy_blocks_from(src, [1, 4], [0, 2])
    assert torch.equal(cache.data[[0, 2]], src.data[[1, 4]])


def test_llama_pool_keeps_its_k_and_v_views(tiny_model):
    cfg = ModelConfig.from_folder(tiny_model("llama"))
    cache = KVCache(cfg, num_blocks=3, block_size=16, dtype=torch.float32)
    assert not cache.is_latent
    k, v = cache.layers[0]
    assert k.shape == v.shape == (3, 16, cfg.num_kv_heads, cfg.head_dim)
