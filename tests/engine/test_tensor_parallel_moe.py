"""Tensor parallelism of Qwen3, Qwen3-MoE and the MLA + MoE decoders (DeepSeek-V2/V3): 2 ranks
compute what one computes, with uneven head runs, split experts and DeepSeek's attention
biases; the shares are the documented ones; what cannot split is refused."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM
from pdserve.common.model_config import ModelConfig
from pdserve.engine.model.loader import load_model
from pdserve.engine.parallel.shard_plan import check_tensor_parallel, shard_plan
from tests.conftest import hf_logits
from tests.engine.test_parity import _engine_logits
from tests.engine.test_tensor_parallel import assert_two_ranks_match_one

# Every tiny model has an odd head count or odd KV head count, so 2 ranks get uneven runs:
# DeepSeek 3 heads (1 + 2, the latent whole on both), Qwen3 3 KV heads (1 + 2, with 2 + 4
# query heads). MoE layers split each expert's columns (DeepSeek 24: 12 + 12, Qwen3-MoE
# 40: 20 + 20); DeepSeek-V2 with 2 shared experts splits their 48 columns 24 + 24.
VARIANTS = {
    "deepseek_v3": ("deepseek_v3", {}),  # q_lora_rank, sigmoid grouped routing
    "deepseek_v2": ("deepseek_v2", {"n_shared_experts": 2}),  # plain q_proj, softmax greedy
    "deepseek_v3-bias": ("deepseek_v3", {"attention_bias": True}),  # o_proj bias added once
    "qwen3_moe": ("qwen3_moe", {}),  # layer 1 dense (mlp_only_layers)
    "qwen3": ("qwen3", {}),
}
BIASED = {"v3": ("deepseek_v3", {"attention_bias": True}),
          "v2": ("deepseek_v2", {"attention_bias": True})}
# DeepSeek-V2-Lite's shape
V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
           "intermediate_size": 10944, "num_hidden_layers": 27, "num_attention_heads": 16,
           "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
           "n_shared_experts": 2, "first_k_dense_replace": 1}


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_match_one_and_leave_no_process(tiny_model, variant):
    """Greedy tokens and logits (1e-4, fp32) of one process through chunked prefill, decode
    and a prefix-cache hit; every block back; the child rank gone after close."""
    arch, overrides = VARIANTS[variant]
    assert_two_ranks_match_one(tiny_model(arch, **overrides))


@pytest.mark.parametrize("variant", BIASED)
def test_deepseek_attention_biases_match_transformers(tiny_model, variant):
    """q_a_proj (V3), kv_a_proj_with_mqa and o_proj biases, as transformers adds them."""
    arch, overrides = BIASED[variant]
    path = tiny_model(arch, **overrides)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256)
    prompt = list(range(30, 70))
    torch.testing.assert_close(_engine_logits(llm, prompt), hf_logits(path, prompt),
                               rtol=1e-4, atol=1e-4)


def test_a_rank_of_deepseek_holds_its_heads_the_whole_latent_and_its_expert_columns(
        tiny_model):
    path = tiny_model("deepseek_v2", n_shared_experts=2)
    cfg = ModelConfig.from_folder(path)
    plan = shard_plan(cfg, 2, 1)
    model = load_model(path, cfg, torch.float32, "cpu", 256, shard=plan)
    full = load_model(path, cfg, torch.float32, "cpu", 256)
    attn, whole = model.layers[0].self_attn, full.layers[0].self_attn
    assert (attn.h, attn.w_uk.shape, attn.w_uv.shape) == (2, (2, 12, 24), (2, 24, 10))
    torch.testing.assert_close(attn.w_uk, whole.w_uk[1:3], rtol=0, atol=0)
    assert attn.kv_a_proj_with_mqa.out_features == whole.kv_a_proj_with_mqa.out_features == 32
    moe, full_moe = model.layers[1].mlp, full.layers[1].mlp
    assert moe.experts.gate_up_proj.shape == (8, 24, 48)  # 12 gate + 12 up rows of 24 each
    torch.testing.assert_close(moe.experts.down_proj, full_moe.experts.down_proj[:, :, 12:],
                               rtol=0, atol=0)
    assert moe.shared_experts.down_proj.in_features == 24  # of 2 x 24 columns
    torch.testing.assert_close(moe.gate.weight, full_moe.gate.weight, rtol=0, atol=0)


def test_mla_heads_split_in_runs_and_expert_columns_in_grains():
    """DeepSeek-V2-Lite on 3 ranks: 5, 5 and 6 heads over one whole latent; each expert's 1,408
    columns in runs of 32-column grains, the 2 shared experts' in the same runs twice as wide;
    the rank with the most heads takes the fewest dense MLP columns."""
    cfg = ModelConfig.from_hf_dict(V2_LITE)
    plans = [shard_plan(cfg, 3, r) for r in range(3)]
    assert [p.q_heads for p in plans] == [range(0, 5), range(5, 10), range(10, 16)]
    assert [p.kv_heads for p in plans] == [range(0, 1)] * 3
    assert [p.expert_columns for p in plans] == [range(0, 480), range(480, 928),
                                                 range(928, 1408)]
    assert [p.shared_columns for p in plans] == [range(0, 960), range(960, 1856),
                                                 range(1856, 2816)]
    # 3,680 + 3,712 + 3,552 of 10,944 (115, 116 and 111 grains)
    assert [p.mlp_columns for p in plans] == [range(0, 3680), range(3680, 7392),
                                              range(7392, 10944)]
    local = plans[2].local_config(cfg)
    assert (local.num_heads, local.moe.intermediate_size, local.intermediate_size) == (
        6, 480, 3552)


@pytest.mark.parametrize(("overrides", "size", "message"), [
    ({"moe_intermediate_size": 2}, 3, "tensor_parallel_size 3 exceeds the model's 2 expert "
                                      "columns (moe_intermediate_size)"),
    ({"num_attention_heads": 2, "num_key_value_heads": 2}, 3,
     "tensor-parallel size 3 exceeds the 2 attention heads of this DeepseekV2ForCausalLM"),
])
def test_what_cannot_split_is_refused_naming_the_numbers(overrides, size, message):
    cfg = ModelConfig.from_hf_dict({**V2_LITE, **overrides})
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_tensor_parallel(cfg, size)
