"""The rotary part of MLA's queries and keys (DeepSeek-V2 paper, arXiv 2405.04434, eq. 11-14).

Pairs: with `rope_interleave` (DeepSeek's checkpoints) adjacent values (x_2i, x_2i+1) rotate by
frequency i, else the halves (x_i, x_i+d/2) as in Llama. Either way the result is written
de-interleaved, [x1 cos - x2 sin, x2 cos + x1 sin] (transformers' DeepSeek-V3
`apply_rotary_pos_emb_interleave` / `rotate_half`); DeepSeek-V2's complex multiply keeps the
pairs interleaved instead, a fixed permutation of the same values applied to q and k alike, so
every q.k is unchanged. The rotated key is what the latent pool stores: one layout per model.
cos/sin carry YaRN's attention factor, as transformers multiplies them by it. V2 rotates in
fp32 (its complex path upcasts), V3 in the activation dtype; on the compiled operators (a bf16
model on CPU) both rotate in fp32, in place, rounding once (`mla_rope_`).
"""

from __future__ import annotations

from types import ModuleType

import torch

from pdserve.common.model_config import ModelConfig
from pdserve.engine.model.rope import one_thread
from pdserve.engine.model.yarn import inv_frequencies


class MlaRotary:
    """cos/sin of every position, built once in fp32 (`rope.one_thread`): [P, d/2] each.
    `ops`: the compiled CPU operators, or None."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device | str,
                 ops: ModuleType | None = None) -> None:
        assert cfg.mla is not None
        inv_freq, attention_factor = inv_frequencies(cfg)
        pos = torch.arange(max_positions, device=device).float()
        freqs = pos[:, None] * inv_freq.to(device)[None, :]  # [P, d/2]
        with one_thread():
            self.cos, self.sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        self.interleave = cfg.mla.rope_interleave
        self.upcast = cfg.architecture == "DeepseekV2ForCausalLM"
        self.ops = ops

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> MlaStepRope:
        """One step's rows, shared by every layer: [T, 1, d/2] cos and sin ([T, d/2] fp32 on
        the operators)."""
        if self.ops is not None:
            return MlaStepRope(self.cos[positions], self.sin[positions], self.interleave,
                               self.ops)
        dtype = torch.float32 if self.upcast else dtype
        return MlaStepRope(self.cos[positions].to(dtype)[:, None, :],
                           self.sin[positions].to(dtype)[:, None, :], self.interleave)


class MlaStepRope:
    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                 ops: ModuleType | None = None) -> None:
        self.cos, self.sin, self.interleave, self.ops = cos, sin, interleave, ops

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, d] -> rotated [T, heads, d] (de-interleaved order, see the module); on
        the operators x itself, rotated in place."""
        if self.ops is not None:
            self.ops.mla_rope_(x, self.cos, self.sin, self.interleave)
            return x
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, heads, d/2] each
        else:
            x1, x2 = x.chunk(2, dim=-1)
        x1, x2 = x1.to(self.cos.dtype), x2.to(self.cos.dtype)
        # RoFormer eq. 34 per pair: (x1 cos - x2 sin, x2 cos + x1 sin)
        out = torch.cat([x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin], dim=-1)
        return out.to(x.dtype)
