"""DeepSeek-V2 / DeepSeek-V3 decoders: Multi-head Latent Attention (`mla_attention.py`) over
the latent pool, a dense SwiGLU MLP in the first `first_k_dense_replace` layers and the
DeepSeekMoE block (`deepseek_moe.py`) after them (`MoeConfig.is_moe_layer`).

Parameter names follow Hugging Face (transformers' `DeepseekV3ForCausalLM` /
`DeepseekV2ForCausalLM`) except that a dense layer's gate/up projections are fused into
`gate_up_proj` and a MoE layer's experts are stacked (`convert_moe_weights`). Runs on PyTorch
operators only (`kernels.supports` is False for MLA): fp32 runs match transformers to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from pdserve.common.model_config import ModelConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model.attention import AttentionMetadata
from pdserve.engine.model.deepseek_moe import DeepseekMoE, convert_moe_weights
from pdserve.engine.model.llama import MLP, RMSNorm
from pdserve.engine.model.mla_attention import MlaAttention
from pdserve.engine.model.mla_rope import MlaRotary, MlaStepRope
from pdserve.engine.model.weights import copy_weights


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, None)
        self.self_attn = MlaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, None)
        self.mlp: nn.Module = DeepseekMoE(cfg.hidden_size, cfg.moe) if moe else MLP(cfg, None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: MlaStepRope,
                kv: tuple[torch.Tensor, ...], meta: AttentionMetadata,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `llama.DecoderLayer.forward`: h = h + attn(norm(h)); h = h + mlp(norm(h)), each
        add fused into the norm after it; returns (this layer's output, residual before it)."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, kv, meta), residual)
        return self.mlp(h), residual


class DeepseekForCausalLM(nn.Module):
    """`fused` is accepted for the registry's signature; MLA models always get None."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device | str,
                 fused: ModuleType | None = None) -> None:
        super().__init__()
        if cfg.mla is None or cfg.moe is None:
            raise ValueError(f"{cfg.architecture}: a DeepSeek decoder needs the MLA and MoE "
                             "fields of its config.json")
        self.cfg = cfg
        self.fused = None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, cfg.moe.is_moe_layer(i))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, None)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        with torch.device(device):  # real tables, also while the layers are built on meta
            self.rope = MlaRotary(cfg, max_positions, device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """`after_layer(i)` runs once layer i has stored this batch's latents in `kv_cache`."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rope.for_step(positions, x.dtype)  # shared by every layer
        residual = None
        for i, (layer, kv) in enumerate(zip(self.layers, kv_cache.layers, strict=True)):
            x, residual = layer(x, residual, rope, kv, meta)
            if after_layer is not None:
                after_layer(i)
        return self.norm(x, residual)[0]  # [T, hidden]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, vocab]

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy a HF state dict in (converted by `_convert`); any missing tensor is an error.
        Then split each kv_b_proj for the absorbed decode (`MlaAttention.absorb`)."""
        converted = _convert(weights, self.cfg)
        copy_weights(self, converted)
        for layer in self.layers:
            layer.self_attn.absorb()


class DeepseekV2ForCausalLM(DeepseekForCausalLM):
    pass


class DeepseekV3ForCausalLM(DeepseekForCausalLM):
    pass


def _convert(w: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names -> this model's: "model." dropped, dense gate/up fused, MoE experts stacked."""
    assert cfg.moe is not None
    out = {k.removeprefix("model."): v for k, v in w.items()}
    for i in range(cfg.num_layers):
        m = f"layers.{i}.mlp."
        if cfg.moe.is_moe_layer(i):
            out |= convert_moe_weights(out, m, cfg.moe)
            continue
        gate, up = out.pop(f"{m}gate_proj.weight", None), out.pop(f"{m}up_proj.weight", None)
        if gate is not None and up is not None:
            out[f"{m}gate_up_proj.weight"] = torch.cat([gate, up], dim=0)  # [2I, hidden]
    if "lm_head.weight" in w:
        out["lm_head.weight"] = w["lm_head.weight"]
    elif cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out
