"""`pdserve bench decode-attention`: the compiled paged decode attention beside the PyTorch path
it replaces and beside a plain read of the same bytes.

A decode step attends each stream's one new query to every position of its context, so at long
contexts this kernel reads a dense model's whole KV cache once per layer: it should run at the
memory's speed. For each batch B and context L, one layer of a model's attention shape (defaults:
SmolLM2-135M's 9 query heads over 3 KV heads of 64), bf16, the contexts' blocks scattered over
the pool (as a worker's pool is after a while):
- operators: `decode_attention`, reading the blocks in place;
- PyTorch: the engine's path without the operators (`index_select` of the blocks, then SDPA);
- read: the same KV bytes summed as fp32 words, the machine's read speed for them (the roof).
Every call follows a 64 MiB write that evicts the caches, as a step's other layers do before the
same layer runs again. Medians of `repeats` calls. `of_read` = read time / operators time (1.0:
the kernel streams the KV as fast as a plain read). Both sides' outputs are compared first.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

import torch

from pdserve.bench.moe_ops_bench import FLUSH_BYTES, check_same, cold_median_us
from pdserve.engine.kernels import cpu_ops
from pdserve.engine.model.attention import DecodeGroup, _decode

BLOCK = 16


@dataclass(frozen=True)
class DecodeAttentionSettings:
    heads: int = 9  # SmolLM2-135M's shape
    kv_heads: int = 3
    head_dim: int = 64
    batches: tuple[int, ...] = (1, 8)
    contexts: tuple[int, ...] = (512, 2048, 8192)
    repeats: int = 9

    def __post_init__(self) -> None:
        if self.heads <= 0 or self.kv_heads <= 0 or self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a positive multiple of kv_heads "
                             f"({self.kv_heads})")
        if self.heads // self.kv_heads > 8 or self.head_dim not in (64, 128):
            raise ValueError(f"the kernel takes head sizes 64 and 128 with up to 8 query heads "
                             f"per KV head, not {self.head_dim} and "
                             f"{self.heads // self.kv_heads}")
        if not self.batches or min(self.batches) <= 0:
            raise ValueError("batches must be positive integers")
        if not self.contexts or min(self.contexts) <= 0:
            raise ValueError("contexts must be positive integers")
        if self.repeats <= 0:
            raise ValueError(f"repeats must be positive, got {self.repeats}")


@dataclass(frozen=True)
class DecodeAttentionRow:
    batch: int
    context: int
    kv_mb: float
    pytorch_us: float
    operators_us: float
    read_us: float

    @property
    def speedup(self) -> float:
        return self.pytorch_us / self.operators_us

    @property
    def gb_per_s(self) -> float:
        return self.kv_mb / self.operators_us * 1e3  # MB per us = TB/s

    @property
    def of_read(self) -> float:
        return self.read_us / self.operators_us


def measure(ops, b: int, length: int, s: DecodeAttentionSettings,
            flush: torch.Tensor) -> DecodeAttentionRow:
    gen = torch.Generator().manual_seed(b * 100_003 + length)
    per_seq = -(-length // BLOCK)
    shape = (b * per_seq, BLOCK, s.kv_heads, s.head_dim)
    k_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(b * per_seq, generator=gen).view(b, per_seq)
    lens = torch.full((b,), length)
    q = torch.randn(b, s.heads, s.head_dim, generator=gen).to(torch.bfloat16)
    group = DecodeGroup(0, tables.flatten(), lens, BLOCK)
    scale = s.head_dim**-0.5

    def operators() -> torch.Tensor:
        return ops.decode_attention(q, k_cache, v_cache, tables, lens, scale)

    def pytorch() -> torch.Tensor:
        return _decode(q, k_cache, v_cache, group, scale)

    words = (k_cache.view(torch.float32), v_cache.view(torch.float32))  # the same bytes
    check_same(f"decode_attention B{b} L{length}", operators().float(), pytorch().float(), 2e-2)
    return DecodeAttentionRow(
        b, length, 2 * k_cache.numel() * k_cache.element_size() / 1e6,
        cold_median_us(pytorch, s.repeats, flush), cold_median_us(operators, s.repeats, flush),
        cold_median_us(lambda: [w.sum() for w in words], s.repeats, flush))


def run(s: DecodeAttentionSettings, ops) -> list[DecodeAttentionRow]:
    flush = torch.empty(FLUSH_BYTES // 4)
    with torch.inference_mode():
        return [measure(ops, b, n, s, flush) for b in s.batches for n in s.contexts]


def format_table(rows: list[DecodeAttentionRow]) -> str:
    head = (f"{'batch':>6}{'context':>9}{'KV MB':>8}{'PyTorch us':>12}{'operators us':>14}"
            f"{'read us':>10}{'GB/s':>7}{'x PyTorch':>11}{'of read':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.batch:>6}{r.context:>9}{r.kv_mb:>8.1f}{r.pytorch_us:>12.0f}"
                     f"{r.operators_us:>14.0f}{r.read_us:>10.0f}{r.gb_per_s:>7.1f}"
                     f"{r.speedup:>11.2f}{r.of_read:>9.2f}")
    return "\n".join(lines)


def main(s: DecodeAttentionSettings, as_json: bool) -> int:
    ops = cpu_ops()
    if ops is None:
        print("pdserve bench decode-attention: the compiled CPU operators are not available "
              "here (they need a C++ compiler)", file=sys.stderr)
        return 1
    print(f"{s.heads} query heads over {s.kv_heads} KV heads of {s.head_dim}, bf16, "
          f"{torch.get_num_threads()} threads, medians of {s.repeats} calls after a cache "
          f"flush", file=sys.stderr)
    rows = run(s, ops)
    if as_json:
        for r in rows:
            print(json.dumps({"kind": "decode_attention"} | asdict(r)
                             | {"speedup": round(r.speedup, 3), "of_read": round(r.of_read, 3),
                                "gb_per_s": round(r.gb_per_s, 2)}))
    else:
        print(format_table(rows))
    return 0
