"""`pdserve bench attention`: the compiled prefill attention beside PyTorch's SDPA, same shapes.

For each prompt length n, one layer's causal attention of n query rows (H heads, KVH KV heads,
head size D: a model's shape) over a context of `cached` + n positions, in bf16:
- pdserve: `prefill_attention` over the paged pool (or the named kernel of it: `amx`,
  `avx512_bf16`, `avx2`), read in place through a block table that scatters the context over
  the pool (as a worker's pool is after a while);
- SDPA: `torch.nn.functional.scaled_dot_product_attention` on the contiguous K/V (its CPU flash
  kernel: 4-D inputs, `is_causal` when nothing is cached, else a boolean mask), the engine's
  path without the compiled operators, given the gather for free.
Both run on this process's threads. FLOPs: QK^T and PV, 2 x 2 x H x D per (query, key) pair
attended, over the causal pairs only (n x cached + n (n + 1) / 2). Medians of `repeats` runs
of each, one side after the other.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from pdserve.bench.timing import median_seconds
from pdserve.engine.kernels import cpu_ops

BLOCK = 16
# the kernels of prefill_attention by the name `prefill_attention_kernel` gives them: the
# operator's name, and that of the check whether this CPU (and, for AMX, its kernel) runs it
KERNELS = {"amx": ("prefill_attention_amx", "amx_available"),
           "avx512_bf16": ("prefill_attention_dpbf16", "dpbf16_available"),
           "avx2": ("prefill_attention_fma", "prefill_attention_fma_available")}


@dataclass(frozen=True)
class AttentionRow:
    prompt_tokens: int
    cached_tokens: int
    pdserve_ms: float
    sdpa_ms: float
    flops: float

    @property
    def speedup(self) -> float:
        return self.sdpa_ms / self.pdserve_ms

    @property
    def pdserve_gflops(self) -> float:
        return self.flops / self.pdserve_ms / 1e6

    @property
    def sdpa_gflops(self) -> float:
        return self.flops / self.sdpa_ms / 1e6


@dataclass(frozen=True)
class AttentionSettings:
    lengths: tuple[int, ...] = (512, 1000, 2048, 8191)
    cached: int = 0
    heads: int = 9  # SmolLM2-135M's shape
    kv_heads: int = 3
    head_dim: int = 64
    repeats: int = 5
    kernel: str = ""  # one of KERNELS; "": the one prefill_attention runs here

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) <= 0:
            raise ValueError("prompt lengths must be positive integers")
        if self.cached < 0:
            raise ValueError(f"cached must be >= 0, got {self.cached}")
        if self.heads <= 0 or self.kv_heads <= 0 or self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a positive multiple of kv_heads "
                             f"({self.kv_heads})")
        if self.head_dim % 64:
            raise ValueError(f"the kernel takes head sizes that are multiples of 64, not "
                             f"{self.head_dim}")
        if self.repeats <= 0:
            raise ValueError(f"repeats must be positive, got {self.repeats}")
        if self.kernel and self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, not {self.kernel!r}")


def runs_here(ops, kernel: str) -> bool:
    """Whether this CPU (and the kernel's grant, for AMX) runs the named kernel."""
    return getattr(ops, KERNELS[kernel][1])()


def measure(ops, n: int, s: AttentionSettings) -> AttentionRow:
    gen = torch.Generator().manual_seed(n)
    length = s.cached + n
    blocks = -(-length // BLOCK)
    shape = (blocks, BLOCK, s.kv_heads, s.head_dim)
    k_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    table = torch.randperm(blocks, generator=gen)
    q = torch.randn(n, s.heads, s.head_dim, generator=gen).to(torch.bfloat16)
    scale = s.head_dim ** -0.5
    # SDPA's inputs: the context in order, [1, heads, positions, D]
    k = k_cache.index_select(0, table).flatten(0, 1)[:length].transpose(0, 1)[None]
    v = v_cache.index_select(0, table).flatten(0, 1)[:length].transpose(0, 1)[None]
    qs = q.transpose(0, 1)[None]
    mask = None
    if s.cached:
        mask = torch.arange(length)[None, :] <= (s.cached + torch.arange(n))[:, None]
    # one side after the other, not interleaved: a call right after the other side's finds
    # the caches and thread pool as that left them (up to 40% off this kernel here)
    attend = getattr(ops, KERNELS[s.kernel][0]) if s.kernel else ops.prefill_attention
    ours = median_seconds(lambda: attend(q, k_cache, v_cache, table, length, scale), s.repeats)
    theirs = median_seconds(
        lambda: F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, is_causal=mask is None,
                                               scale=scale, enable_gqa=True), s.repeats)
    pairs = n * s.cached + n * (n + 1) / 2
    return AttentionRow(n, s.cached, ours * 1e3, theirs * 1e3,
                        4 * s.heads * s.head_dim * pairs)


def format_table(rows: list[AttentionRow]) -> str:
    head = (f"{'prompt':>7}{'cached':>8}{'pdserve ms':>12}{'GFLOP/s':>9}{'SDPA ms':>10}"
            f"{'GFLOP/s':>9}{'x SDPA':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.prompt_tokens:>7}{r.cached_tokens:>8}{r.pdserve_ms:>12.2f}"
                     f"{r.pdserve_gflops:>9.0f}{r.sdpa_ms:>10.2f}{r.sdpa_gflops:>9.0f}"
                     f"{r.speedup:>8.2f}")
    return "\n".join(lines)


def main(s: AttentionSettings, as_json: bool) -> int:
    ops = cpu_ops()
    if ops is None or not ops.prefill_attention_available():
        print("pdserve bench attention: the compiled prefill attention is not available here "
              "(it needs AVX512-BF16, or AVX2 and FMA, and a C++ compiler)", file=sys.stderr)
        return 1
    if s.kernel and not runs_here(ops, s.kernel):
        print(f"pdserve bench attention: this CPU does not run the {s.kernel} kernel (it runs "
              f"{ops.prefill_attention_kernel()})", file=sys.stderr)
        return 1
    print(f"H={s.heads} KVH={s.kv_heads} D={s.head_dim}, {torch.get_num_threads()} threads, "
          f"pdserve's kernel on {s.kernel or ops.prefill_attention_kernel()}, medians of "
          f"{s.repeats}", file=sys.stderr)
    rows = [measure(ops, n, s) for n in s.lengths]
    if as_json:
        for r in rows:
            print(json.dumps(asdict(r) | {"speedup": round(r.speedup, 3)}))
    else:
        print(format_table(rows))
    return 0
