"""Roofline cost models: prefill of one prompt and one decode step, per GPU of a TP group.

time = max(FLOPs / (peak FLOP/s x MFU), bytes / (memory bandwidth x MBU))   (roofline model:
Williams, Waterman, Patterson, "Roofline", CACM 2009), with
- FLOPs of a matmul: 2 per multiply-add, so a token through N params costs 2N FLOPs (Kaplan et
  al., "Scaling Laws for Neural Language Models", arXiv 2001.08361, section 2.1: C_fwd ~ 2N).
- causal attention, per layer and query head: query i scores i+1 keys (2 x d_qk FLOPs each) and
  sums i+1 values (2 x d_v each); over a T-token prompt that is T(T+1)/2 query-key pairs
  (the 2 n_layer n_ctx d_attn term of Kaplan et al. Table 1, halved for the causal mask).
- MLA decode runs in the absorbed form (DeepSeek-V2 paper, arXiv 2405.04434, section 2.1.2:
  W_UK folds into W_Q and W_UV into W_O), so heads score over the latent: d_qk = d_c + d_rope and
  d_v = d_c. MLA prefill uses the expanded form: d_qk = nope + rope, d_v = v_head_dim.
- MFU (model FLOPs utilization, as defined in the PaLM paper, arXiv 2204.02311, appendix B) and
  MBU (the achieved fraction of memory bandwidth) are assumptions: DEFAULT_MFU 0.5 and
  DEFAULT_MBU 0.8, to be replaced by measured values (`pdserve bench engine`).
Tensor parallelism divides FLOPs and weight bytes evenly over tp ranks; its all-reduce cost is
not modelled (fold it into MFU). The embedding lookup reads batch x hidden values and is ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.planner.hardware import Hardware
from pdserve.planner.kv_math import check_tp
from pdserve.planner.model_shape import ModelShape

DEFAULT_MFU = 0.5
DEFAULT_MBU = 0.8


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of the peaks: 0 < mfu <= 1 and 0 < mbu <= 1."""

    mfu: float = DEFAULT_MFU
    mbu: float = DEFAULT_MBU

    def __post_init__(self) -> None:
        for name in ("mfu", "mbu"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                0 < value <= 1
            ):
                raise ValueError(f"{name} (--{name}) must be a fraction in (0, 1], "
                                 f"got {value!r}")


@dataclass(frozen=True)
class PhaseTime:
    """Per-GPU work of one phase and its roofline time; seconds = max(compute, memory)."""

    flops: float
    bytes: float
    compute_seconds: float
    memory_seconds: float

    @property
    def seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"


def roofline(flops: float, nbytes: float, hw: Hardware, weight_dtype: str,
             eff: Efficiency) -> PhaseTime:
    """FLOPs / (peak x MFU) beside bytes / (bandwidth x MBU)."""
    compute = flops / (hw.peak_flops(weight_dtype) * eff.mfu)
    memory = nbytes / (hw.memory_bandwidth * eff.mbu)
    return PhaseTime(flops=flops, bytes=nbytes, compute_seconds=compute, memory_seconds=memory)


def prefill_attention_flops(shape: ModelShape, tokens: int) -> float:
    """2 x T(T+1)/2 pairs x heads x (d_qk + d_v) x layers (causal, expanded MLA)."""
    pairs = tokens * (tokens + 1) / 2
    return 2 * pairs * shape.num_heads * (shape.qk_head_dim + shape.v_head_dim) * shape.num_layers


def prefill_flops(shape: ModelShape, tokens: int) -> float:
    """Whole-model FLOPs to prefill a `tokens`-token prompt.

    2 x active block params x tokens, plus the LM head once (only the last position's logits
    are needed to sample token 0), plus causal attention.
    """
    linear = 2 * shape.body_active_params * tokens
    logits = 2 * shape.lm_head_params
    return linear + logits + prefill_attention_flops(shape, tokens)


def weight_bytes_read(shape: ModelShape, tokens: int) -> float:
    """Weight bytes one forward pass over `tokens` tokens reads (whole model).

    Dense body + the routed experts those tokens touch (MoEShape.params_read) + the LM head.
    """
    routed = shape.moe.params_read(tokens) if shape.moe else 0.0
    params = shape.body_dense_params + routed + shape.lm_head_params
    return params * shape.weight_bytes_per_param


def prefill_time(shape: ModelShape, hw: Hardware, tokens: int, kv_bytes_per_token_rank: int,
                 tp: int, eff: Efficiency, prompts: int = 1) -> PhaseTime:
    """`prompts` prompts of `tokens` tokens in one prefill step on a TP group.

    FLOPs = prompts x prefill_flops / tp (each prompt attends only to itself); bytes = weights
    read once for all prompts x tokens tokens / tp + the KV they write on this rank.
    """
    check_tp(tp)
    flops = prompts * prefill_flops(shape, tokens) / tp
    all_tokens = prompts * tokens
    nbytes = weight_bytes_read(shape, all_tokens) / tp + kv_bytes_per_token_rank * all_tokens
    return roofline(flops, nbytes, hw, shape.weight_dtype, eff)


def decode_attention_flops(shape: ModelShape, context: float) -> float:
    """One new token attending over `context` cached tokens: 2 x context x heads x
    (d_qk + d_v) x layers, with MLA in the absorbed form (d_qk = d_c + d_rope, d_v = d_c)."""
    if shape.is_mla:
        d_qk, d_v = shape.kv_lora_rank + shape.qk_rope_head_dim, shape.kv_lora_rank
    else:
        d_qk, d_v = shape.qk_head_dim, shape.v_head_dim
    return 2 * context * shape.num_heads * (d_qk + d_v) * shape.num_layers


def decode_step_time(shape: ModelShape, hw: Hardware, batch: int, context: float,
                     kv_bytes_per_token_rank: int, tp: int, eff: Efficiency) -> PhaseTime:
    """One decode step for `batch` requests of mean `context` tokens on a TP group.

    FLOPs = batch x (2 x (active block params + LM head) + attention) / tp;
    bytes = weights read (experts touched by `batch` tokens) / tp + batch x context x KV/token
    on this rank (every step reads each request's whole cache).
    """
    check_tp(tp)
    if batch <= 0:
        raise ValueError(f"decode_batch (--decode-batch) must be a positive integer, got {batch}")
    per_token = 2 * (shape.body_active_params + shape.lm_head_params)
    flops = batch * (per_token + decode_attention_flops(shape, context)) / tp
    nbytes = weight_bytes_read(shape, batch) / tp + batch * context * kv_bytes_per_token_rank
    return roofline(flops, nbytes, hw, shape.weight_dtype, eff)


def stored_weight_bytes_per_gpu(shape: ModelShape, tp: int) -> float:
    """Weights one GPU stores: all params (every expert) x bytes per param / tp."""
    check_tp(tp)
    return shape.params_total * shape.weight_bytes_per_param / tp


def min_tp_for_weights(shape: ModelShape, usable_bytes: float) -> int:
    """Smallest power-of-two tp whose weight shard fits in `usable_bytes`.

    GPUs needed = ceil(weight bytes / usable bytes), rounded up to a power of two: TP groups are
    1, 2, 4, 8, ... GPUs in practice, and powers of two split the usual head counts evenly.
    """
    gpus = max(1, math.ceil(shape.params_total * shape.weight_bytes_per_param / usable_bytes))
    return 2 ** math.ceil(math.log2(gpus))
