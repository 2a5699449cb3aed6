"""Paged attention in Triton, reading K/V blocks in place from the pool (no gather, no padding
to the longest context, no mask tensor): the GPU's kernels (`attention.PagedKernels`).

- decode: one query token per sequence. One program per (sequence, KV head): the G = H / KVH
  query heads that share the KV head (head h uses KV head h // G, as transformers'
  `repeat_kv`) attend together, so each K/V block is read once for the group.
- prefill: a prompt's n new tokens at positions [context_len - n, context_len), causal, over
  every earlier position in the pool (a cached prefix included). One program per (tile of
  ROWS query rows, head); it reads only the blocks up to its last row's position.

Both walk a block table with an online softmax (Milakov & Gimelshein 2018, as FlashAttention):
  m_i = max(m_{i-1}, max_j s_j),  l_i = l_{i-1} e^{m_{i-1} - m_i} + sum_j e^{s_j - m_i},
  acc_i = acc_{i-1} e^{m_{i-1} - m_i} + sum_j e^{s_j - m_i} v_j,  out = acc_n / l_n,
with s_j = scale * q.k_j, every sum in fp32 whatever the pool's dtype.

Decode reads lengths and tables on the device, so a launch has the same shape for every step
of a batch size: what a CUDA graph replays (`engine/decode_graphs.py`).

Where Triton is not installed `available()` is False and attention keeps PyTorch's SDPA. On a
machine without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 before
Triton is imported), which is how the tests check them against SDPA there.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from pdserve.engine.model.attention import PagedKernels

# Triton's dot needs tile sides of at least 16
MIN_DOT = 16


def available(device: torch.device | str) -> bool:
    """The kernels run on `device`: a CUDA device with Triton installed."""
    return torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D] (any strides but a
    contiguous last axis); tables [B, W] long, the blocks of each sequence in order (entries
    past its length are never read); lens [B] long, positions each sequence attends (>= 1).
    Returns [B, H, D] in q's dtype."""
    b, h, d = q.shape
    kvh, block_size = _check(q, k_cache, v_cache)
    if tables.shape[0] != b or lens.shape[0] != b:
        raise ValueError(f"shapes do not fit: q {list(q.shape)}, tables {list(tables.shape)}, "
                         f"lens {list(lens.shape)}")
    tables = tables.contiguous()
    out = torch.empty_like(q)
    _kernels().paged_decode_kernel[(b, kvh)](
        q, k_cache, v_cache, out, tables, lens, scale,
        q.stride(0), q.stride(1), *_cache_strides(k_cache, v_cache),
        out.stride(0), out.stride(1), tables.stride(0),
        GROUP=h // kvh, GROUP_P=_pow2(h // kvh), HEAD_DIM=d, HEAD_DIM_P=_pow2(d),
        BLOCK_SIZE=block_size, BLOCK_SIZE_P=_pow2(block_size),
    )
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_ids: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """q [n, H, D], the queries at positions [context_len - n, context_len), whose K/V (and
    every earlier position's) are in the pool already; block_ids [>= context_len / block_size]
    long, the prompt's blocks in order. Returns [n, H, D] in q's dtype, causal."""
    n, h, d = q.shape
    kvh, block_size = _check(q, k_cache, v_cache)
    if not 0 < n <= context_len or block_ids.shape[0] * block_size < context_len:
        raise ValueError(f"{n} queries, a context of {context_len} and {block_ids.shape[0]} "
                         f"blocks of {block_size} do not fit")
    rows = 64 if d <= 128 else 32
    out = torch.empty_like(q)
    _kernels().paged_prefill_kernel[(-(-n // rows), h)](
        q, k_cache, v_cache, out, block_ids.contiguous(), n, context_len, scale,
        q.stride(0), q.stride(1), *_cache_strides(k_cache, v_cache),
        out.stride(0), out.stride(1),
        GROUP=h // kvh, HEAD_DIM=d, HEAD_DIM_P=max(MIN_DOT, _pow2(d)), BLOCK_SIZE=block_size,
        KEYS_P=max(MIN_DOT, _pow2(block_size)), ROWS=rows,
        # Triton's interpreter (CPU tensors) multiplies bf16 dots wrongly: fp32 there. A GPU
        # multiplies the pool's dtype (bf16 on tensor cores), accumulating in fp32.
        DOT_FP32=not q.is_cuda,
    )
    return out


KERNELS = PagedKernels(decode=decode_attention, prefill=prefill_attention)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """(KV heads, block size) of a cache that fits q; else ValueError."""
    h, d = q.shape[1], q.shape[2]
    if h % k_cache.shape[2] or k_cache.shape[3] != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"shapes do not fit: q {list(q.shape)}, cache {list(k_cache.shape)}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q and the caches need a contiguous head_dim axis")
    return k_cache.shape[2], k_cache.shape[1]


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    return (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))


def _pow2(n: int) -> int:
    """The smallest power of two >= n (Triton's tile sides are powers of two)."""
    return 1 << max(0, n - 1).bit_length()


def _kernels() -> ModuleType:
    """The compiled kernels' module, imported on first use (importing Triton costs a CPU
    engine nothing)."""
    try:
        from pdserve.engine.model import triton_kernels
    except ImportError as e:
        raise RuntimeError("paged attention on a GPU needs Triton (pip install triton)") from e
    return triton_kernels


def self_check(device: torch.device | str, dtype: torch.dtype) -> None:
    """Run both kernels once on a small case (GQA, sequences over scattered blocks, ending
    mid-block; a prompt of 21 new tokens after 19 cached) and compare them with attention
    written out in PyTorch; raise RuntimeError if one differs, or whatever Triton raises if it
    cannot compile here."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, d, bs = 4, 2, 64, 16
    k_cache, v_cache = (torch.randn(6, bs, kv_heads, d, generator=gen) for _ in range(2))
    q = torch.randn(21, heads, d, generator=gen)
    tables, lens = torch.tensor([[4, 0, 2], [5, 1, 3]]), [40, 17]
    keys = [c[tables[i]].flatten(0, 1) for c in (k_cache, v_cache) for i in range(2)]
    decode_ref = torch.stack([attend(q[i], keys[i][:n], keys[2 + i][:n], d**-0.5)
                              for i, n in enumerate(lens)])
    prefill_ref = torch.stack([attend(q[j], keys[0][:20 + j], keys[2][:20 + j], d**-0.5)
                               for j in range(21)])

    def on(*tensors: torch.Tensor) -> list[torch.Tensor]:
        return [t.to(device, dtype if t.is_floating_point() else t.dtype) for t in tensors]

    decode = decode_attention(*on(q[:2], k_cache, v_cache, tables, torch.tensor(lens)),
                              d**-0.5)
    prefill = prefill_attention(*on(q, k_cache, v_cache, tables[0]), 40, d**-0.5)
    for name, out, ref in (("decode", decode, decode_ref), ("prefill", prefill, prefill_ref)):
        err = (out.float().cpu() - ref).abs().max().item()
        if not err <= (1e-4 if dtype == torch.float32 else 5e-2):
            raise RuntimeError(f"the {name} kernel's output differs from PyTorch's by {err:.3g}")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, D], k and v [L, KVH, D] -> [H, D]: softmax(q k^T scale) v, head h on KV head
    h // (H / KVH)."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, D]
    weights = torch.softmax(torch.einsum("hd,lhd->hl", q, k) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", weights, v)
