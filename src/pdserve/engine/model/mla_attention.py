"""Multi-head Latent Attention over the latent pool (DeepSeek-V2 paper, arXiv 2405.04434,
section 2.1.2, eqs. 9-19; transformers' `DeepseekV3Attention`).

Per token t, with r = kv_lora_rank, d_n = qk_nope_head_dim, d_r = qk_rope_head_dim, d_v =
v_head_dim, H heads:
  q_t = W_UQ norm(W_DQ h_t)  (or W_Q h_t without q_lora_rank), split per head into
        q_nope [H, d_n] and q_rope [H, d_r], q_rope rotated              (eqs. 12-13, 37-38)
  [c_t, k_rope_t] = W_DKV h_t (kv_a_proj_with_mqa); c_t = norm(c_t) [r]; k_rope_t rotated,
        [d_r], shared by every head                                        (eqs. 9, 14)
  k_nope = W_UK c_t, v = W_UV c_t per head (kv_b_proj = [W_UK; W_UV] per head) (eqs. 10-11)
  o_t,h = sum_s softmax_s(scale (q_nope . k_nope_s + q_rope . k_rope_s)) v_s    (eq. 18)
The pool keeps only [c_t, k_rope_t] per token and layer (`engine/kv_cache.py`).

Prefill expands the latent of every context position (the cached prefix read from the pool)
into per-head k and v and attends causally with SDPA. Decode uses the absorbed form (paper,
section 2.1.2 "during inference"): q_nope . (W_UK c) = (W_UK^T q_nope) . c, so each head's
query moves into latent space, all heads attend one shared [c, k_rope] row per position (MQA
over the latent: no per-head K/V is ever built), and the latent-space output goes through W_UV.
The softmax scale is 1/sqrt(d_n + d_r) times YaRN's mscale^2 (`yarn.softmax_scale`).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.common.model_config import ModelConfig
from pdserve.engine.model.attention import AttentionMetadata, DecodeGroup, PrefillSeq
from pdserve.engine.model.llama import RMSNorm
from pdserve.engine.model.mla_rope import MlaStepRope
from pdserve.engine.model.packed_linear import onednn_packs
from pdserve.engine.model.yarn import softmax_scale

# transformers builds q_a_layernorm and kv_a_layernorm with this eps, not config.rms_norm_eps
LATENT_NORM_EPS = 1e-6


def absorbed_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype decode's absorbed matmuls run in: the weight's, except a bf16 or fp16 weight on
    a CPU where oneDNN has no path for it (AVX2-only cores), whose batched matmul PyTorch
    emulates: fp32 there, much faster at decode's shapes (`pdserve bench moe` times the
    whole step). Either way the sums are fp32 and the result is rounded
    to the model's dtype once."""
    low = weight.dtype in (torch.bfloat16, torch.float16)
    if weight.device.type == "cpu" and low and not onednn_packs(weight.dtype):
        return torch.float32
    return weight.dtype


class MlaAttention(nn.Module):
    """`w_uk` [H, d_n, r], `w_uv` [H, r, d_v]: kv_b_proj's key and value halves per head (the
    value half transposed: decode multiplies latent rows by it), copied out by `absorb()`
    once the weights are loaded (the linear itself may be repacked afterwards), in
    `absorbed_dtype`.

    With `attention_bias` q_a_proj, kv_a_proj_with_mqa and o_proj carry a bias, as in
    transformers (a plain q_proj never does). `cfg.num_heads` is this process's heads: a
    tensor-parallel rank's run of them (`engine/parallel/shard_plan.py`), the latent whole.
    `ops`: the compiled CPU operators (a bf16 model on CPU) for the two latent norms and the
    whole absorbed decode (`mla_decode`, on bf16 `w_uk` and `w_uv`), or None."""

    def __init__(self, cfg: ModelConfig, ops: ModuleType | None = None) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.h, self.r = cfg.num_heads, mla.kv_lora_rank
        self.d_nope, self.d_rope, self.d_v = mla.qk_nope_head_dim, mla.qk_rope_head_dim, \
            mla.v_head_dim
        hidden, qk, bias = cfg.hidden_size, mla.qk_head_dim, cfg.attention_bias
        self.q_lora = mla.q_lora_rank is not None
        if mla.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, ops)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, self.h * qk, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, self.h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.r + self.d_rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.r, LATENT_NORM_EPS, ops)
        self.kv_b_proj = nn.Linear(self.r, self.h * (self.d_nope + self.d_v), bias=False)
        self.o_proj = nn.Linear(self.h * self.d_v, hidden, bias=bias)
        self.register_buffer("w_uk", torch.empty(self.h, self.d_nope, self.r), persistent=False)
        self.register_buffer("w_uv", torch.empty(self.h, self.r, self.d_v), persistent=False)
        self.scale = softmax_scale(cfg)
        self._ops = ops

    @torch.no_grad()
    def absorb(self) -> None:
        """Split kv_b_proj's weight [H (d_n + d_v), r] into w_uk [H, d_n, r], w_uv [H, r, d_v],
        in `absorbed_dtype` (the weight's own on the operators, which widen it as they read)."""
        w = self.kv_b_proj.weight.view(self.h, self.d_nope + self.d_v, self.r)
        dtype = w.dtype if self._ops is not None else absorbed_dtype(w)
        self.w_uk = w[:, : self.d_nope].to(dtype).contiguous()
        self.w_uv = w[:, self.d_nope :].transpose(1, 2).to(dtype).contiguous()

    def forward(self, x: torch.Tensor, rope: MlaStepRope, kv: tuple[torch.Tensor, ...],
                meta: AttentionMetadata) -> torch.Tensor:
        (cache,) = kv  # [num_blocks, block_size, r + d_r]
        t = x.shape[0]
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))[0])  # [T, H (d_n + d_r)]
        else:
            q = self.q_proj(x)
        q_nope, q_rope = q.view(t, self.h, -1).split([self.d_nope, self.d_rope], dim=-1)
        q_rope = rope.rotate(q_rope)  # [T, H, d_r]
        latent = self._store(self.kv_a_proj_with_mqa(x), rope, cache, meta)
        if not meta.prefills and len(meta.decode_groups) == 1:  # every row one decode group
            o = self._decode(q_nope, q_rope, cache, meta.decode_groups[0])  # [T, H, d_v]
            return self.o_proj(o.reshape(t, self.h * self.d_v))
        o = x.new_empty(t, self.h, self.d_v)  # [T, H, d_v]
        for seq in meta.prefills:
            rows = slice(seq.token_start, seq.token_start + seq.num_tokens)
            new = None if latent is None else latent[rows]
            o[rows] = self._prefill(q_nope[rows], q_rope[rows], new, cache, seq)
        for group in meta.decode_groups:
            o[group.rows] = self._decode(q_nope[group.rows], q_rope[group.rows], cache, group)
        return self.o_proj(o.reshape(t, self.h * self.d_v))

    def _store(self, kv: torch.Tensor, rope: MlaStepRope, cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor | None:
        """kv [T, r + d_r] (kv_a_proj_with_mqa's output) -> this step's latent rows [norm(c) ;
        rotated k_rope], written into the pool at the step's slots and returned [T, r + d_r];
        on the operators one `mla_store_` call (the same bits) that returns None: a prefill
        reads its rows back from the pool."""
        if self._ops is not None:
            self._ops.mla_store_(kv, self.kv_a_layernorm.weight, LATENT_NORM_EPS, rope.cos,
                                 rope.sin, rope.interleave, cache, meta.slot_blocks,
                                 meta.slot_offsets)
            return None
        c, k_rope = kv.split([self.r, self.d_rope], dim=-1)
        c = self.kv_a_layernorm(c)[0]  # [T, r]
        k_rope = rope.rotate(k_rope[:, None, :])[:, 0]  # [T, d_r]
        latent = torch.cat([c, k_rope], dim=-1)  # [T, r + d_r]
        cache[meta.slot_blocks, meta.slot_offsets] = latent
        return latent

    def _prefill(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor | None,
                 cache: torch.Tensor, seq: PrefillSeq) -> torch.Tensor:
        """q_nope [n, H, d_n], q_rope [n, H, d_r], latent: this step's rows [n, r + d_r], or
        None to read them from the pool -> [n, H, d_v]."""
        if seq.mask is not None or latent is None:  # the context's rows, from the pool
            blocks = cache.index_select(0, seq.block_ids)  # [nb, block_size, r + d_r]
            latent = blocks.flatten(0, 1)[: seq.context_len]  # [L, r + d_r]
        length = latent.shape[0]
        c, k_rope = latent.split([self.r, self.d_rope], dim=-1)  # [L, r], [L, d_r]
        kv = self.kv_b_proj(c).view(length, self.h, self.d_nope + self.d_v)  # [L, H, d_n + d_v]
        k_nope, v = kv.split([self.d_nope, self.d_v], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None, :].expand(length, self.h, self.d_rope)],
                      dim=-1)  # [L, H, d_n + d_r]
        q = torch.cat([q_nope, q_rope], dim=-1)  # [n, H, d_n + d_r]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=seq.mask, is_causal=seq.mask is None, scale=self.scale,
        )  # [1, H, n, d_v]
        return o[0].transpose(0, 1)  # [n, H, d_v]

    def _decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                group: DecodeGroup) -> torch.Tensor:
        """q_nope [B, H, d_n], q_rope [B, H, d_r] -> [B, H, d_v], over the group's paged
        latent, never expanded per head: one `mla_decode` call on the operators, else
        computed in the absorbed weights' dtype (where that is wider than the pool's, the
        latents are widened once and the result rounded once)."""
        b, dtype = q_nope.shape[0], self.w_uk.dtype
        if self._ops is not None:
            return self._ops.mla_decode(q_nope, q_rope, cache, group.blocks.view(b, -1),
                                        group.lens, self.w_uk, self.w_uv, self.scale)
        length = group.mask.shape[-1]
        latent = cache.index_select(0, group.blocks).view(b, length, -1)  # [B, L, r + d_r]
        # (W_UK^T q_nope) per head: [H, B, d_n] x [H, d_n, r] -> [H, B, r]
        q_latent = torch.bmm(q_nope.transpose(0, 1).to(dtype), self.w_uk).transpose(0, 1)
        q = torch.cat([q_latent, q_rope.to(dtype)], dim=-1)  # [B, H, r + d_r]
        # The H heads are H queries of one shared latent "head" (MQA): scores = q_latent . c +
        # q_rope . k_rope; the values are the latents c themselves.
        if dtype == cache.dtype:
            o_latent = F.scaled_dot_product_attention(
                q[:, None], latent[:, None], latent[:, None, :, : self.r],
                attn_mask=group.mask, scale=self.scale)[:, 0]  # [B, H, r]
        else:  # PyTorch's SDPA would multiply in the pool's dtype, emulated here
            o_latent = _attend(q, latent.to(dtype), self.r, group.mask[:, 0], self.scale)
        # W_UV per head: [H, B, r] x [H, r, d_v] -> [H, B, d_v]
        o = torch.bmm(o_latent.transpose(0, 1), self.w_uv)
        return o.transpose(0, 1).to(q_rope.dtype)  # [B, H, d_v]


def _attend(q: torch.Tensor, latent: torch.Tensor, r: int, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q [B, H, r + d_r], latent [B, L, r + d_r], mask [B, 1, L] bool (True: attend) ->
    [B, H, r]: softmax(scale q . latent) over the unmasked positions, times their first r
    columns (Vaswani et al. 2017, eq. 1)."""
    scores = torch.bmm(q, latent.transpose(1, 2)) * scale  # [B, H, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), latent[..., :r])  # [B, H, r]
