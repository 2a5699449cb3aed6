"""Qwen3 and Qwen3-MoE decoders: the Llama layer with an RMSNorm over each q and k head before
RoPE (transformers' `Qwen3Attention`: `q_norm`, `k_norm` of width head_dim), and in Qwen3-MoE
a sparse block of routed experts (softmax top-k, no shared experts) in the layers
`MoeConfig.is_moe_layer` picks, the dense MLP (`intermediate_size`) in the others.

Everything but the layers is `LlamaForCausalLM`'s (rotary tables, q|k|v and gate|up fusing
at load) or its `DecoderStack`'s (embeddings, forward loop, logits). With the compiled CPU
operators (`ops`, a bf16 model on CPU) the norms (q and k heads' included), a dense MLP's
activation, rotary, the KV store, paged attention (where `kernels.covers_attention`) and the
MoE routing run on them, each layer through Python; the routed experts are
`packed_experts.py`'s, the router's linear packed with the others (`packed_linear.py`).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from pdserve.common.model_config import ModelConfig
from pdserve.common.moe_config import MoeConfig
from pdserve.engine.kernels import covers_attention
from pdserve.engine.model.attention import AttentionMetadata, paged_attention
from pdserve.engine.model.llama import MLP, LlamaForCausalLM, RMSNorm
from pdserve.engine.model.moe import Experts, stack_expert_weights
from pdserve.engine.model.moe_gate import route
from pdserve.engine.model.rope import StepRope


class Qwen3Attention(nn.Module):
    """`norm_ops`, `ops`: the compiled CPU operators for the q and k norms, and for rotary (in
    place), the KV store and attention; or None (PyTorch's)."""

    def __init__(self, cfg: ModelConfig, norm_ops: ModuleType | None,
                 ops: ModuleType | None) -> None:
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.ops = ops
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, norm_ops)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, norm_ops)
        self.scale = self.d**-0.5

    def forward(self, x: torch.Tensor, rope: StepRope, kv: tuple,
                meta: AttentionMetadata) -> torch.Tensor:
        t, q_width, qk_width = x.shape[0], self.h * self.d, (self.h + self.kvh) * self.d
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) D]
        # each head normalised on its own: rows of D
        q = self.q_norm(qkv[:, :q_width].reshape(t * self.h, self.d))[0]  # [T H, D]
        k = self.k_norm(qkv[:, q_width:qk_width].reshape(t * self.kvh, self.d))[0]  # [T KVH, D]
        qk = torch.cat([q.view(t, q_width), k.view(t, qk_width - q_width)], dim=1)
        q, k = rope.rotate(qk, self.h + self.kvh, self.d).split([self.h, self.kvh], dim=1)
        v = qkv[:, qk_width:].view(t, self.kvh, self.d)  # [T, KVH, D]
        o = paged_attention(q, k, v, *kv, meta, self.scale, self.ops)  # [T, H, D]
        return self.o_proj(o.reshape(t, q_width))


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's MoE MLP (transformers' `Qwen3MoeSparseMoeBlock`): the router's logits from
    `gate.weight [E, hidden]` (a linear layer in x's dtype, packed like the others), softmax
    top-k routing (`moe_gate.route`), the stacked `experts`. `ops`: the compiled CPU operators
    for the routing, or None."""

    def __init__(self, hidden_size: int, moe: MoeConfig, ops: ModuleType | None = None) -> None:
        super().__init__()
        self.cfg, self.ops = moe, ops
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, hidden_size, moe.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.cfg, ops=self.ops)  # [T, k] each
        return self.experts(x, ids, weights)  # [T, hidden]


class Qwen3DecoderLayer(nn.Module):
    """`ops`: the compiled CPU operators for the norms and a dense MLP's activation;
    `attention_ops`: the same, or None where they do not cover the heads."""

    def __init__(self, cfg: ModelConfig, index: int, ops: ModuleType | None,
                 attention_ops: ModuleType | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Qwen3Attention(cfg, ops, attention_ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        moe = cfg.moe is not None and cfg.moe.is_moe_layer(index)
        self.mlp = (SparseMoeBlock(cfg.hidden_size, cfg.moe, ops) if moe
                    else MLP(cfg.hidden_size, cfg.intermediate_size, ops))

    def forward(self, x, residual, rope, kv, meta):
        """As `llama.DecoderLayer.forward`: returns (this layer's output, residual before it)."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, kv, meta), residual)
        return self.mlp(h), residual


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3ForCausalLM and Qwen3MoeForCausalLM (which layers are MoE comes from `cfg.moe`).
    `fused`: the compiled CPU operators or None; the stack itself (`self.fused`) never has
    them, as its layers are not Llama's (`LlamaForCausalLM.layer_call`)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device | str,
                 fused: ModuleType | None = None) -> None:
        super().__init__(cfg, max_positions, device, None)
        self._attention_ops = fused if fused is not None and covers_attention(cfg) else None
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, i, fused, self._attention_ops)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)

    def step_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRope:
        return self.rope.for_step(positions, dtype, self._attention_ops)

    def convert_layer(self, weights: dict[str, torch.Tensor], index: int) -> None:
        """As Llama's, with a MoE layer's experts stacked first (either checkpoint layout)."""
        if isinstance(self.layers[index].mlp, SparseMoeBlock):
            weights |= stack_expert_weights(weights, f"layers.{index}.mlp.experts.",
                                            self.cfg.moe.num_experts)
        super().convert_layer(weights, index)
