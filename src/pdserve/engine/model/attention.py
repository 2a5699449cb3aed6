"""Attention over the paged KV pool.

Each step writes the new tokens' K and V into their slots first, then attends:
- prefill (a request computing several tokens): its query tokens against K/V of positions
  [0, context_len), causal with the query offset. With the compiled CPU operators, one flash
  attention kernel reads every position from the pool in place (csrc/prefill_attention.cpp);
  its result for a position does not depend on how the prompt was chunked or what was
  cached. Otherwise PyTorch's SDPA over the fresh K/V when nothing was cached before; with
  earlier positions in the pool, the step's `kernels` read them in place (the Triton kernel
  on a GPU), else SDPA over K/V gathered from the blocks.
- decode (one token per request): in groups of similar context length (`DecodeGroup`, formed
  by the runner), each group at once. A kernel reads each request's blocks in place where
  one runs (the compiled CPU operators; `triton_paged` on a GPU, the step's `kernels`);
  otherwise SDPA over the blocks gathered into a padded [B, max_blocks * block_size] context,
  padding masked out. One group for the whole batch would make a batch of short chats beside
  one long prompt pay the long context B times.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

# (q [B, H, D], k_cache, v_cache, tables [B, W], lens [B], scale) -> [B, H, D]
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                         float], torch.Tensor]
# (q [n, H, D], k_cache, v_cache, block_ids [nb], context_len, scale) -> [n, H, D], causal
PrefillKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float],
                         torch.Tensor]


@dataclass(frozen=True)
class PagedKernels:
    """Attention that reads the pool's blocks in place, for steps off the compiled CPU
    operators (on a GPU: `triton_paged.KERNELS`). The step's new K/V are in the pool before
    either runs."""

    decode: DecodeKernel
    prefill: PrefillKernel


@dataclass
class PrefillSeq:
    token_start: int  # first row of this sequence in the flattened batch
    num_tokens: int  # query tokens this step
    context_len: int  # positions attended: cached + new
    block_ids: torch.Tensor  # [num_blocks] long

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[n, context_len] bool: the causal mask of the n queries at positions [start,
        context_len), None when nothing was cached before (plain causal attention over this
        step's K/V). The SDPA path only: built on first use, shared by every layer."""
        start = self.context_len - self.num_tokens
        if start == 0:
            return None
        device = self.block_ids.device
        q_pos = torch.arange(start, self.context_len, device=device)
        return torch.arange(self.context_len, device=device)[None, :] <= q_pos[:, None]


@dataclass
class DecodeGroup:
    start: int  # first row of the group's B decode tokens (one per request, consecutive)
    blocks: torch.Tensor  # [B * max_blocks] long: the group's block tables, padded, flat
    lens: torch.Tensor  # [B] long: positions each request attends (its new token included)
    block_size: int

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.lens.shape[0])

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, 1, max_blocks * block_size] bool: the real positions of the padded context
        (the SDPA path only; built once per step, on first use, shared by every layer)."""
        width = self.blocks.numel() // self.lens.shape[0] * self.block_size
        pos = torch.arange(width, device=self.lens.device)
        return (pos[None, :] < self.lens[:, None])[:, None, None, :]


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] long: block of each new token
    slot_offsets: torch.Tensor  # [T] long: offset inside that block
    prefills: list[PrefillSeq]
    decode_groups: list[DecodeGroup]  # cover the decode rows, which follow the prefill rows
    # None: SDPA, over gathered blocks where a context is in the pool already
    kernels: PagedKernels | None = None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    fused: ModuleType | None = None,
) -> torch.Tensor:
    """`fused`: the compiled CPU operators (bf16): the new K/V rows are stored in one pass and
    decode groups read their blocks in place, with no gather, padding or mask."""
    # q [T, H, D]; k, v [T, KVH, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]
    if fused is not None:  # one pass; two index_puts on the strided cache were ~8% of a step
        fused.store_kv_(k, v, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)
    else:
        k_cache[meta.slot_blocks, meta.slot_offsets] = k
        v_cache[meta.slot_blocks, meta.slot_offsets] = v
    decode = (_in_place_decode(fused.decode_attention) if fused is not None
              else _decode if meta.kernels is None else _in_place_decode(meta.kernels.decode))
    if not meta.prefills and len(meta.decode_groups) == 1:  # one steady group: no copies
        return decode(q, k_cache, v_cache, meta.decode_groups[0], scale)
    out = torch.empty_like(q)
    flash = fused is not None and fused.prefill_attention_available()
    for seq in meta.prefills:
        rows = slice(seq.token_start, seq.token_start + seq.num_tokens)
        if flash:  # over the pool in place: the new rows' K/V were stored above
            out[rows] = fused.prefill_attention(q[rows], k_cache, v_cache, seq.block_ids,
                                                seq.context_len, scale)
        elif meta.kernels is not None and seq.context_len > seq.num_tokens:  # a prefix in the pool
            out[rows] = meta.kernels.prefill(q[rows], k_cache, v_cache, seq.block_ids,
                                             seq.context_len, scale)
        else:
            out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, seq, scale)
    for group in meta.decode_groups:
        out[group.rows] = decode(q[group.rows], k_cache, v_cache, group, scale)
    return out


def _in_place_decode(kernel: DecodeKernel) -> Callable[..., torch.Tensor]:
    """A decode group through a kernel that reads the blocks in place."""
    def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               group: DecodeGroup, scale: float) -> torch.Tensor:
        tables = group.blocks.view(group.lens.shape[0], -1)  # [B, max_blocks]
        return kernel(q, k_cache, v_cache, tables, group.lens, scale)

    return decode


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    # index_select copies whole blocks; advanced indexing is ~5x slower on this strided view
    blocks = cache.index_select(0, block_ids)  # [nb, block_size, KVH, D]
    return blocks.flatten(0, 1)[:length]  # [length, KVH, D]


def _prefill(q, k, v, k_cache, v_cache, seq: PrefillSeq, scale: float) -> torch.Tensor:
    if seq.mask is not None:  # earlier positions are in the cache, not in this step's K/V
        k = _gather(k_cache, seq.block_ids, seq.context_len)
        v = _gather(v_cache, seq.block_ids, seq.context_len)
    # 4-D inputs: PyTorch's CPU flash kernel takes them (3-D falls back to the math path, ~15x
    # slower for a 1,000-token prompt here).
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale, enable_gqa=True,
    )  # [1, H, n, D]
    return o[0].transpose(0, 1)  # [n, H, D]


def _decode(q, k_cache, v_cache, group: DecodeGroup, scale: float) -> torch.Tensor:
    b, length = q.shape[0], group.mask.shape[-1]
    k = k_cache.index_select(0, group.blocks).view(b, length, *k_cache.shape[2:])
    v = v_cache.index_select(0, group.blocks).view(b, length, *v_cache.shape[2:])
    kvh = k.shape[2]  # k, v [B, L, KVH, D]
    # The G = H / KVH query heads sharing a KV head (head h uses KV head h // G, as HF's
    # repeat_kv) attend as G queries of one sequence: no K/V expansion, ~2.5x faster here.
    o = F.scaled_dot_product_attention(
        q.view(b, kvh, -1, q.shape[-1]),  # [B, KVH, G, D]
        k.transpose(1, 2), v.transpose(1, 2),  # [B, KVH, L, D]
        attn_mask=group.mask, scale=scale,
    )  # [B, KVH, G, D]
    return o.reshape(q.shape)  # [B, H, D]
