"""Llama-family decoder (Llama, Qwen2, Mistral): GQA, RoPE, RMSNorm, SwiGLU.

Parameter names follow Hugging Face except that q/k/v and gate/up projections are fused into
`qkv_proj` and `gate_up_proj` (fewer, larger matmuls per layer); `load_hf_weights` fuses them.
Norms compute in fp32 and cast back, exactly as HF does, so fp32 runs match HF to rounding.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.common.model_config import ModelConfig
from pdserve.engine.kernels import supports
from pdserve.engine.model.attention import AttentionMetadata, paged_attention
from pdserve.engine.model.decoder_stack import DecoderStack, LayerCall
from pdserve.engine.model.packed_linear import KernelLinear
from pdserve.engine.model.rope import RotaryEmbedding, StepRope


class RMSNorm(nn.Module):
    """Adds the residual stream, then normalises it: (norm(x + residual), x + residual), or
    (norm(x), x) without one. With `fused` (the CPU operators) both are one call."""

    def __init__(self, dim: int, eps: float, fused: ModuleType | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = fused

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused is not None:  # the operators take rows one after another in memory
            x = x.contiguous()
            if residual is None:
                return self.fused.rms_norm(x, self.weight, self.eps), x
            return self.fused.add_rms_norm(x, residual.contiguous(), self.weight, self.eps)
        if residual is not None:
            x = x + residual
        # x [T, dim]; y = w * x / sqrt(mean(x^2) + eps)  (Zhang & Sennrich 2019)
        # fp32 inside, cast back, then the weight: HF's rounding points (bit-identical here)
        w = self.weight
        return w * F.rms_norm(x.float(), w.shape, eps=self.eps).to(x.dtype), x


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: ModuleType | None) -> None:
        super().__init__()
        self.fused = fused
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        out = (self.h + 2 * self.kvh) * self.d
        self.qkv_proj = nn.Linear(cfg.hidden_size, out, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.scale = self.d**-0.5

    def forward(self, x, rope: StepRope, kv: tuple, meta: AttentionMetadata):
        t, qk_width = x.shape[0], (self.h + self.kvh) * self.d
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) D]
        # q and k heads are adjacent: one rotary pass over [T, H + KVH, D]
        q, k = rope.rotate(qkv, self.h + self.kvh, self.d).split([self.h, self.kvh], dim=1)
        v = qkv[:, qk_width:].view(t, self.kvh, self.d)
        o = paged_attention(q, k, v, *kv, meta, self.scale, self.fused)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.h * self.d))


class MLP(nn.Module):
    """SwiGLU with gate|up fused: a dense layer's MLP, and DeepSeek's shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int,
                 fused: ModuleType | None) -> None:
        super().__init__()
        self.fused = fused
        self.inter = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if self.fused is not None:
            return self.down_proj(self.fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: ModuleType | None) -> None:
        super().__init__()
        self.fused = fused
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        self.self_attn = Attention(cfg, fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, fused)

    def forward(self, x, residual, rope, kv, meta):
        """x: the previous layer's output (the embeddings first, with residual None);
        returns this layer's output and the residual stream before it (vLLM's layout: each
        add is fused into the norm that follows it). Same adds, same order as
        h = h + attn(norm(h)); h = h + mlp(norm(h))."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, kv, meta), residual)
        return self.mlp(h), residual

    def fused_forward(self, x: torch.Tensor, residual: torch.Tensor | None, step: Any,
                      kv: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` as one call of the operators' `fused_layer` (the same operators, no
        Python between them); `step` is the step's `LayerStep`."""
        return self.fused.fused_layer(x, residual, self._fused_weights, step, *kv)

    @functools.cached_property
    def _fused_weights(self) -> Any:
        """The layer's weights for `fused_layer`, gathered on first use (after packing)."""
        attn, mlp = self.self_attn, self.mlp
        w = self.fused.LayerWeights()
        w.input_norm = self.input_layernorm.weight
        w.post_norm = self.post_attention_layernorm.weight
        w.qkv, w.qkv_bias = attn.qkv_proj.packed, attn.qkv_proj.bias
        w.o_proj, w.gate_up, w.down = (attn.o_proj.packed, mlp.gate_up_proj.packed,
                                       mlp.down_proj.packed)
        w.kernel = attn.qkv_proj.kernel.name
        w.heads, w.kv_heads, w.head_dim = attn.h, attn.kvh, attn.d
        w.eps, w.scale = self.input_layernorm.eps, attn.scale
        return w

    def linears(self) -> list[nn.Module]:
        a, m = self.self_attn, self.mlp
        return [a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj]


class LlamaForCausalLM(DecoderStack):
    """`fused`: pdserve's compiled CPU operators (`pdserve.engine.kernels.cpu_ops()`), for a
    bf16 model on CPU, or None for PyTorch operators throughout. Kept only where they cover
    the whole layer (`kernels.supports`): the Python layer path passes them to its attention."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device | str,
                 fused: ModuleType | None = None) -> None:
        fused = fused if fused is not None and supports(cfg) else None
        super().__init__(cfg, (DecoderLayer(cfg, fused) for _ in range(cfg.num_layers)),
                         RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused), fused)
        with torch.device(device):  # real tables, also while the layers are built on meta
            self.rope = RotaryEmbedding(cfg, max_positions, device)

    def step_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRope:
        return self.rope.for_step(positions, dtype, self.fused)

    def layer_call(self, positions: torch.Tensor, meta: AttentionMetadata,
                   rope: StepRope) -> LayerCall:
        """A step on the operators' kernels runs each layer as one C++ call
        (`DecoderLayer.fused_forward`, same result); any other step runs `forward`."""
        step = self._fused_step(positions, meta)
        if step is None:
            return super().layer_call(positions, meta, rope)
        return lambda layer, x, residual, kv: layer.fused_forward(x, residual, step, kv)

    def _fused_step(self, positions: torch.Tensor, meta: AttentionMetadata) -> Any:
        """What a step's layers share for `DecoderLayer.fused_forward`, or None where the
        layers run through Python: PyTorch operators, a linear not on one of pdserve's kernels,
        or a prompt in the step without the operators' prefill attention (it then goes through
        PyTorch's SDPA). The rows are the prompts' in order, then the decode groups'
        (`AttentionMetadata`; checked here, else Python)."""
        if self.fused is None or self._layer_kernel is None:
            return None
        if meta.prefills and not self.fused.prefill_attention_available():
            return None
        if not _rows_in_order(meta):
            return None
        step = self.fused.LayerStep()
        step.positions, step.cos, step.sin_signed = positions, self.rope.cos, self.rope.sin_signed
        step.slot_blocks, step.slot_offsets = meta.slot_blocks, meta.slot_offsets
        step.prompt_tables = [seq.block_ids for seq in meta.prefills]
        step.prompt_tokens = [seq.num_tokens for seq in meta.prefills]
        step.prompt_context = [seq.context_len for seq in meta.prefills]
        step.tables = [g.blocks.view(g.lens.shape[0], -1) for g in meta.decode_groups]
        step.lens = [g.lens for g in meta.decode_groups]
        return step

    @functools.cached_property
    def _layer_kernel(self) -> str | None:
        """The linear kernel every layer runs on, or None (found on the first forward, after
        `pack_linears`)."""
        names = {m.kernel.name if isinstance(m, KernelLinear) else None
                 for layer in self.layers for m in layer.linears()}
        return names.pop() if len(names) == 1 else None

    def convert_layer(self, weights: dict[str, torch.Tensor], index: int) -> None:
        """q/k/v (weights and biases) fused into qkv_proj, gate/up into gate_up_proj."""
        a = f"layers.{index}.self_attn."
        for kind in ("weight", "bias"):
            parts = [weights.pop(f"{a}{p}_proj.{kind}", None) for p in "qkv"]
            if all(p is not None for p in parts):
                weights[f"{a}qkv_proj.{kind}"] = torch.cat(parts, dim=0)
        fuse_gate_up(weights, f"layers.{index}.mlp.")


def _rows_in_order(meta: AttentionMetadata) -> bool:
    """The step's rows are its prompts' in order, then its decode groups', with no gap."""
    row = 0
    for seq in meta.prefills:
        if seq.token_start != row:
            return False
        row += seq.num_tokens
    for group in meta.decode_groups:
        if group.start != row:
            return False
        row += group.lens.shape[0]
    return True


def fuse_gate_up(weights: dict[str, torch.Tensor], prefix: str) -> None:
    """`MLP`'s gate_up_proj from a checkpoint's gate_proj and up_proj under `prefix` (e.g.
    "layers.3.mlp."), in place; a lone one is dropped (then gate_up_proj is missing)."""
    gate = weights.pop(f"{prefix}gate_proj.weight", None)
    up = weights.pop(f"{prefix}up_proj.weight", None)
    if gate is not None and up is not None:
        weights[f"{prefix}gate_up_proj.weight"] = torch.cat([gate, up], dim=0)  # [2I, hidden]
