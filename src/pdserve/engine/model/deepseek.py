"""DeepSeek-V2 / DeepSeek-V3 decoders: Multi-head Latent Attention (`mla_attention.py`) over
the latent pool, a dense SwiGLU MLP in the first `first_k_dense_replace` layers and the
DeepSeekMoE block (`deepseek_moe.py`) after them (`MoeConfig.is_moe_layer`).

Parameter names follow Hugging Face (transformers' `DeepseekV3ForCausalLM` /
`DeepseekV2ForCausalLM`) except that a dense layer's gate/up projections are fused into
`gate_up_proj` and a MoE layer's experts are stacked (`convert_moe_weights`). No whole-layer
compiled call (`kernels.supports` is False for MLA): a bf16 model on CPU takes the compiled
operators for the parts they cover, layer by layer in Python (norms, the MLPs' activation,
MLA's rotary, latent store and absorbed decode, the router's fp32 logits and noaux_tc routing,
linears and routed experts packed after loading); fp32 runs are PyTorch's and match
transformers to rounding.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from pdserve.common.model_config import ModelConfig
from pdserve.engine.model.attention import AttentionMetadata
from pdserve.engine.model.decoder_stack import DecoderStack
from pdserve.engine.model.deepseek_moe import DeepseekMoE, convert_moe_weights
from pdserve.engine.model.llama import MLP, RMSNorm, fuse_gate_up
from pdserve.engine.model.mla_attention import MlaAttention
from pdserve.engine.model.mla_rope import MlaRotary, MlaStepRope


class DeepseekDecoderLayer(nn.Module):
    """`ops`: the compiled CPU operators for the norms, MLA, the MoE block or a dense MLP's
    activation, or None."""

    def __init__(self, cfg: ModelConfig, moe: bool, ops: ModuleType | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = MlaAttention(cfg, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp: nn.Module = (DeepseekMoE(cfg.hidden_size, cfg.moe, ops) if moe
                               else MLP(cfg.hidden_size, cfg.intermediate_size, ops))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: MlaStepRope,
                kv: tuple[torch.Tensor, ...], meta: AttentionMetadata,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `llama.DecoderLayer.forward`: h = h + attn(norm(h)); h = h + mlp(norm(h)), each
        add fused into the norm after it; returns (this layer's output, residual before it)."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, kv, meta), residual)
        return self.mlp(h), residual


class DeepseekForCausalLM(DecoderStack):
    """`fused`: the compiled CPU operators, handed to each layer's parts (see the module's
    docstring), or None; the stack itself (`self.fused`) never has them, as its layers are
    not Llama's."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device | str,
                 fused: ModuleType | None = None) -> None:
        if cfg.mla is None or cfg.moe is None:
            raise ValueError(f"{cfg.architecture}: a DeepSeek decoder needs the MLA and MoE "
                             "fields of its config.json")
        layers = (DeepseekDecoderLayer(cfg, cfg.moe.is_moe_layer(i), fused)
                  for i in range(cfg.num_layers))
        super().__init__(cfg, layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused), None)
        with torch.device(device):  # real tables, also while the layers are built on meta
            self.rope = MlaRotary(cfg, max_positions, device, fused)

    def step_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> MlaStepRope:
        return self.rope.for_step(positions, dtype)

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """As `DecoderStack`'s, then each kv_b_proj split for the absorbed decode
        (`MlaAttention.absorb`)."""
        super().load_hf_weights(weights)
        for layer in self.layers:
            layer.self_attn.absorb()

    def convert_layer(self, weights: dict[str, torch.Tensor], index: int) -> None:
        """A dense layer's gate/up fused, a MoE layer's experts stacked."""
        m = f"layers.{index}.mlp."
        if self.cfg.moe.is_moe_layer(index):
            weights |= convert_moe_weights(weights, m, self.cfg.moe)
        else:
            fuse_gate_up(weights, m)


class DeepseekV2ForCausalLM(DeepseekForCausalLM):
    pass


class DeepseekV3ForCausalLM(DeepseekForCausalLM):
    pass
