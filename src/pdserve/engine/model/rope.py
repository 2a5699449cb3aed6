"""Rotary position embedding, computed the way Hugging Face Llama computes it.

inv_freq[i] = theta^(-2i/d) (RoFormer, Su et al. 2021); the "llama3" variant rescales long
wavelengths (Llama 3.1 report; transformers `_compute_llama3_parameters`). cos/sin tables are
built once in fp32 with the same operations as HF so fp32 results match bit for bit.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from types import ModuleType

import torch

from pdserve.common.model_config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type", "default")) == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq  # [d/2]


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """PyTorch's CPU operators on the calling thread alone, for a model's rotary tables.

    Built by two threads (the first parallel region of a fresh process, which starts the
    pool's second thread), the second thread's half of a [256, 64] `cos` came out wrong by up
    to 1.5e-4 in 10 of 200 fresh processes on a 2-vCPU Xeon VM, and 0 of 200 on one thread;
    recomputed later in the same process it was right. A table is every later step's
    rotation: one bad build changes all of an engine's logits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class RotaryEmbedding:
    """cos/sin tables for every position, built once (`one_thread`); `tables()` picks one
    step's rows."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device | str) -> None:
        inv_freq = inv_frequencies(cfg).to(device)
        pos = torch.arange(max_positions, device=device).float()
        freqs = pos[:, None] * inv_freq[None, :]  # [P, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, d]
        half = cfg.head_dim // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(device)
        with one_thread():
            # rotate_half(x) * sin == roll(x, d/2) * (sign * sin): one roll instead of two
            # slices, a negation and a concatenation; negation is exact, so bit-identical.
            self.cos, self.sin_signed = emb.cos(), emb.sin() * sign  # fp32 [P, d]

    def tables(self, positions: torch.Tensor, dtype: torch.dtype):
        # positions [T] -> cos, signed sin [T, 1, d] in the activation dtype (as HF casts them)
        return (self.cos[positions].to(dtype)[:, None, :],
                self.sin_signed[positions].to(dtype)[:, None, :])

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype,
                 fused: ModuleType | None) -> StepRope:
        """The rotation of one step's tokens, shared by every layer: with `fused` (the CPU
        operators) each layer rotates in place straight from the fp32 tables; otherwise the
        step's rows are cast once to `dtype` and applied as HF does."""
        if fused is not None:
            return StepRope(positions, None, fused, self)
        return StepRope(positions, self.tables(positions, dtype), None, self)


class StepRope:
    """One step's rotary embedding, made once per forward and shared by its layers."""

    def __init__(self, positions: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor] | None,
                 fused: ModuleType | None, rope: RotaryEmbedding) -> None:
        self.positions, self.tables, self.fused, self.rope = positions, tables, fused, rope

    def rotate(self, qkv: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        """qkv [T, width] whose first `heads` heads (q, then k) rotate -> [T, heads, head_dim]."""
        t = qkv.shape[0]
        if self.fused is not None:  # in place, fp32 math, one call for every head
            self.fused.rope_(qkv, self.positions, self.rope.cos, self.rope.sin_signed, heads,
                             head_dim)
            return qkv[:, : heads * head_dim].view(t, heads, head_dim)
        return apply_rope(qkv[:, : heads * head_dim].view(t, heads, head_dim), *self.tables)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # x [T, heads, d]: x * cos + rotate_half(x) * sin  (RoFormer eq. 34, HF's formulation)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
