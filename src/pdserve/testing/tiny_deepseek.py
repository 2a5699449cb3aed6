"""Tiny DeepSeek-V2/V3 configs for `tiny_models` (which has transformers write the folder).

Sizes are deliberately odd so that no width coincides with another: 3 heads, kv_lora_rank 24,
qk_nope_head_dim 12, qk_rope_head_dim 8, v_head_dim 10, q_lora_rank 20 (V3; None in V2, a plain
q_proj as DeepSeek-V2-Lite). Layer 0 is a dense MLP, layer 1 a DeepSeekMoE block (8 routed
experts of width 24, 2 per token, one shared expert); `first_k_dense_replace=2` overrides make
every layer dense.
"""

from __future__ import annotations

from typing import Any

DEEPSEEK_ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM",
                          "deepseek_v2": "DeepseekV2ForCausalLM"}

_COMMON: dict[str, Any] = {
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_attention_heads": 3,
    "num_key_value_heads": 3,
    "kv_lora_rank": 24,
    "qk_nope_head_dim": 12,
    "qk_rope_head_dim": 8,
    "head_dim": 8,  # transformers sets head_dim to qk_rope_head_dim
    "v_head_dim": 10,
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
    "n_shared_experts": 1,
    "attention_bias": False,
}

_PER_ARCH: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"q_lora_rank": 20, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
                    "routed_scaling_factor": 2.5, "rope_interleave": True},
    "deepseek_v2": {"q_lora_rank": None, "topk_method": "greedy", "norm_topk_prob": False,
                    "routed_scaling_factor": 1.0, "mlp_bias": False},
}


def deepseek_defaults(arch: str) -> dict[str, Any]:
    """config.json fields of a tiny `arch` ("deepseek_v3" or "deepseek_v2")."""
    return {**_COMMON, **_PER_ARCH[arch]}

