"""Attention over the paged KV pool.

Each step writes the new tokens' K and V into their slots first, then attends:
- prefill (a request computing several tokens): its query tokens against K/V of positions
  [0, context_len), taken straight from the fresh K/V when nothing was cached before, else
  gathered from its blocks; causal with the query offset.
- decode (one token per request): the whole batch at once, every request's blocks gathered
  into a padded [B, max_blocks * block_size] context, padding masked out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    token_start: int  # first row of this sequence in the flattened batch
    num_tokens: int  # query tokens this step
    context_len: int  # positions attended: cached + new
    block_ids: torch.Tensor  # [num_blocks] long


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] long: block of each new token
    slot_offsets: torch.Tensor  # [T] long: offset inside that block
    prefills: list[PrefillSeq]
    decode_start: int  # rows [decode_start, T) are decode tokens, one per request
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] long, padded with block 0
    decode_context_lens: torch.Tensor | None  # [B] long


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    # q [T, H, D]; k, v [T, KVH, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]
    k_cache[meta.slot_blocks, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, meta.slot_offsets] = v
    out = torch.empty_like(q)
    for seq in meta.prefills:
        rows = slice(seq.token_start, seq.token_start + seq.num_tokens)
        out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, seq, scale)
    if meta.decode_block_tables is not None:
        rows = slice(meta.decode_start, q.shape[0])
        out[rows] = _decode(q[rows], k_cache, v_cache, meta, scale)
    return out


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    blocks = cache[block_ids]  # [nb, block_size, KVH, D]
    return blocks.flatten(0, 1)[:length]  # [length, KVH, D]


def _prefill(q, k, v, k_cache, v_cache, seq: PrefillSeq, scale: float) -> torch.Tensor:
    n, ctx = seq.num_tokens, seq.context_len
    if ctx == n:  # nothing cached before: the fresh K/V are the whole context
        mask, causal = None, True
    else:
        k = _gather(k_cache, seq.block_ids, ctx)
        v = _gather(v_cache, seq.block_ids, ctx)
        q_pos = torch.arange(ctx - n, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [n, ctx]
        causal = False
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),  # [H|KVH, len, D]
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
    )  # [H, n, D]
    return o.transpose(0, 1)  # [n, H, D]


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    b, max_blocks = tables.shape
    length = max_blocks * k_cache.shape[1]
    k = k_cache[tables].view(b, length, *k_cache.shape[2:])  # [B, L, KVH, D]
    v = v_cache[tables].view(b, length, *v_cache.shape[2:])
    mask = torch.arange(length, device=q.device)[None, :] < lens[:, None]  # [B, L]
    o = F.scaled_dot_product_attention(
        q[:, :, None, :],  # [B, H, 1, D]
        k.transpose(1, 2), v.transpose(1, 2),  # [B, KVH, L, D]
        attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True,
    )  # [B, H, 1, D]
    return o[:, :, 0, :]
