"""Rotary frequencies of DeepSeek's MLA (plain or YaRN-scaled) and its softmax scale.

YaRN (Peng et al. 2023, arXiv 2309.00071, section 3): dimensions whose wavelength exceeds the
pretraining context are interpolated by `factor`, those far shorter are kept, a linear ramp in
between; the attention logits are scaled by mscale(factor) = 0.1 ln(factor) + 1. Computed with
the same operations, in the same order, as transformers 5.24 (`modeling_rope_utils.
_compute_yarn_parameters`, `deepseek_v3.yarn_get_mscale` / `yarn_apply_mscale`), so fp32 runs
match it to rounding. The rotary width d is `qk_rope_head_dim` (DeepSeek's config sets
head_dim to it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pdserve.common.model_config import ModelConfig


def rope_type(cfg: ModelConfig) -> str:
    scaling = cfg.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def inv_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [d/2] fp32, attention factor that multiplies cos and sin)."""
    if cfg.mla is None:
        raise ValueError(f"{cfg.architecture} has no MLA rotary part")
    d, base = cfg.mla.qk_rope_head_dim, cfg.rope_theta
    if rope_type(cfg) == "yarn":
        return _yarn(cfg.rope_scaling or {}, d, base, cfg.max_position_embeddings)
    # theta^(-2i/d) (RoFormer, Su et al. 2021)
    return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float) / d)), 1.0


def get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's logit scale: 0.1 x mscale x ln(scale) + 1, or 1 for scale <= 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg: ModelConfig) -> float:
    """1 / sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 for a scaled rope with
    `mscale_all_dim` (DeepSeek-V2/V3: q.k gains mscale twice, once from q and once from k, as
    transformers' `yarn_apply_mscale`)."""
    if cfg.mla is None:
        raise ValueError(f"{cfg.architecture} has no MLA attention")
    scale = cfg.mla.qk_head_dim ** (-0.5)
    scaling = cfg.rope_scaling or {}
    if rope_type(cfg) != "default" and scaling.get("mscale_all_dim", 0):
        mscale = get_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def _yarn(s: dict[str, Any], dim: int, base: float,
          max_positions: int) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    old_len = s.get("original_max_position_embeddings") or max_positions
    attention_factor = s.get("attention_factor")
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale)
                                     / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    low, high = _correction_range(beta_fast, beta_slow, dim, base, old_len,
                                  s.get("truncate", True))
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)  # [d/2]
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - _ramp(low, high, dim // 2)  # 1: short wavelengths kept, 0: interpolated
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _correction_dim(rotations: float, dim: int, base: float, old_len: int) -> float:
    """The dimension whose wavelength fits `rotations` turns in the pretraining context."""
    return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))


def _correction_range(fast: float, slow: float, dim: int, base: float, old_len: int,
                      truncate: bool) -> tuple[float, float]:
    low, high = _correction_dim(fast, dim, base, old_len), _correction_dim(slow, dim, base, old_len)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _ramp(low: float, high: float, n: int) -> torch.Tensor:
    if low == high:
        high += 0.001  # no division by zero (as transformers)
    return torch.clamp((torch.arange(n, dtype=torch.float32) - low) / (high - low), 0, 1)
