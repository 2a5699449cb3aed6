"""`pdserve bench moe-ops`: the compiled operators of a MoE or MLA decode layer beside the
PyTorch path they replace, one call each, same inputs.

Each side is the engine's own code, built once with the compiled operators and once without
(what a model gets where they do not build), at a real layer's shape (defaults:
DeepSeek-V2-Lite's MLA and hidden size, DeepSeek-V3's routing over 64 experts, Qwen3-30B-A3B's
128 experts, top-8), bf16:
- `mla_decode`: `MlaAttention._decode`, the absorbed decode attention of a decode group of B
  requests over L positions each (operators: one `mla_decode` call; PyTorch: the absorbed
  weights in `absorbed_dtype`, a gather of the blocks, two batched matmuls and a softmax);
- `router`: DeepSeek's `Router` (fp32 logits, then noaux_tc);
- `qwen3_router`: Qwen3-MoE's gate linear and softmax top-k (`qwen3.SparseMoeBlock`: the
  packed linear and `softmax_topk_route`, against `F.linear` and `softmax_topk`).
Every call follows a 64 MiB write that evicts the caches, as a decode step's other layers do
before the same layer runs again: the weights come from memory. Medians of `repeats` calls.
Both sides' outputs are compared first (a run whose sides disagree stops with the difference).
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.common.model_config import ModelConfig
from pdserve.common.moe_config import MoeConfig
from pdserve.engine.kernels import cpu_ops
from pdserve.engine.model.attention import DecodeGroup
from pdserve.engine.model.mla_attention import MlaAttention
from pdserve.engine.model.moe_gate import Router, route
from pdserve.engine.model.packed_linear import pack_linears

BLOCK = 16
FLUSH_BYTES = 64 << 20


@dataclass(frozen=True)
class MoeOpsSettings:
    hidden: int = 2048
    heads: int = 16
    kv_lora_rank: int = 512
    batches: tuple[int, ...] = (1, 4)
    contexts: tuple[int, ...] = (256, 2048)
    experts: int = 64
    qwen3_experts: int = 128
    repeats: int = 20

    def __post_init__(self) -> None:
        if self.hidden <= 0 or self.hidden % 64:
            raise ValueError(f"hidden must be a positive multiple of 64, got {self.hidden}")
        if self.heads <= 0 or self.kv_lora_rank <= 0:
            raise ValueError("heads and kv_lora_rank must be positive")
        if not self.batches or min(self.batches) <= 0:
            raise ValueError("batches must be positive integers")
        if not self.contexts or min(self.contexts) <= 0:
            raise ValueError("contexts must be positive integers")
        if self.experts < 16 or self.experts % 8 or self.qwen3_experts < 8:
            raise ValueError("experts must be a multiple of 8, at least 16 (8 groups, top-6), "
                             "and qwen3 experts at least 8 (top-8)")
        if self.repeats <= 0:
            raise ValueError(f"repeats must be positive, got {self.repeats}")


@dataclass(frozen=True)
class OpRow:
    op: str
    case: str
    pytorch_us: float
    operators_us: float

    @property
    def speedup(self) -> float:
        return self.pytorch_us / self.operators_us


def cold_median_us(fn: Callable[[], object], repeats: int, flush: torch.Tensor) -> float:
    """Median microseconds of `repeats` calls of fn, each after writing `flush` (the caches
    then hold none of fn's inputs), after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        flush.fill_(1.0)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _deepseek_config(s: MoeOpsSettings) -> dict:
    return {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 256,
            "hidden_size": s.hidden, "intermediate_size": 4 * s.hidden, "num_hidden_layers": 2,
            "num_attention_heads": s.heads, "kv_lora_rank": s.kv_lora_rank,
            "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "n_routed_experts": s.experts, "num_experts_per_tok": 6,
            "n_group": 8, "topk_group": 4, "n_shared_experts": 1, "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
            "moe_intermediate_size": 256, "max_position_embeddings": 65536,
            "rope_theta": 10000.0}


def check_same(name: str, ours: torch.Tensor, theirs: torch.Tensor, tol: float) -> None:
    diff = (ours.float() - theirs.float()).abs().max().item()
    scale = theirs.float().abs().max().item()
    if diff > tol * max(1.0, scale):
        raise RuntimeError(f"{name}: the operators and PyTorch disagree by {diff:.3g} "
                           f"(largest value {scale:.3g})")


def _mla_pair(cfg: ModelConfig, ops, gen: torch.Generator) -> tuple[MlaAttention, MlaAttention]:
    """The same absorbed weights on both paths: the operators' (bf16) and PyTorch's."""
    ours, theirs = MlaAttention(cfg, ops), MlaAttention(cfg, None)
    with torch.no_grad():
        w = (torch.randn(ours.kv_b_proj.weight.shape, generator=gen) * 0.05).bfloat16()
        for attn in (ours, theirs):
            attn.kv_b_proj.weight = nn.Parameter(w)
            attn.absorb()
    return ours, theirs


def mla_rows(cfg: ModelConfig, ops, s: MoeOpsSettings, flush: torch.Tensor) -> list[OpRow]:
    gen = torch.Generator().manual_seed(0)
    ours, theirs = _mla_pair(cfg, ops, gen)
    mla = cfg.mla
    rows = []
    for b in s.batches:
        for length in s.contexts:
            per = -(-length // BLOCK)
            cache = torch.randn(b * per + 1, BLOCK, mla.kv_lora_rank + mla.qk_rope_head_dim,
                                generator=gen).bfloat16()
            group = DecodeGroup(0, torch.randperm(b * per, generator=gen),
                                torch.full((b,), length), BLOCK)
            q = torch.randn(b, s.heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim,
                            generator=gen).bfloat16()
            q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
            mine = functools.partial(ours._decode, q_nope, q_rope, cache, group)
            other = functools.partial(theirs._decode, q_nope, q_rope, cache, group)
            check_same("mla_decode", mine(), other(), 2e-2)
            rows.append(_row("mla_decode", f"B{b} L{length}", mine, other, s, flush))
    return rows


def router_rows(cfg: dict, ops, s: MoeOpsSettings, flush: torch.Tensor) -> list[OpRow]:
    moe = MoeConfig.from_hf_dict(cfg, "DeepseekV3ForCausalLM")
    ours, theirs = Router(s.hidden, moe, ops), Router(s.hidden, moe, None)
    gen = torch.Generator().manual_seed(1)
    theirs.weight.data.normal_(generator=gen)
    theirs.e_score_correction_bias.normal_(generator=gen)
    ours.load_state_dict(theirs.state_dict())
    rows = []
    for b in s.batches:
        x = torch.randn(b, s.hidden, generator=gen).bfloat16()
        check_same("router ids", ours(x)[1].sort(dim=1)[0], theirs(x)[1].sort(dim=1)[0], 0)
        rows.append(_row("router", f"B{b} E{s.experts}", functools.partial(ours, x),
                         functools.partial(theirs, x), s, flush))
    return rows


def qwen3_rows(ops, s: MoeOpsSettings, flush: torch.Tensor) -> list[OpRow]:
    moe = MoeConfig.from_hf_dict({"num_experts": s.qwen3_experts, "num_experts_per_tok": 8,
                                  "norm_topk_prob": True, "moe_intermediate_size": 256},
                                 "Qwen3MoeForCausalLM")
    gen = torch.Generator().manual_seed(2)
    gate = nn.Sequential(nn.Linear(s.hidden, s.qwen3_experts, bias=False))
    gate[0].weight.data = (torch.randn(s.qwen3_experts, s.hidden, generator=gen) * 0.05
                           ).bfloat16()
    w = gate[0].weight.detach().clone()
    pack_linears(gate, ops)  # as the loader packs the model's linears
    rows = []
    for b in s.batches:
        x = torch.randn(b, s.hidden, generator=gen).bfloat16()
        mine = functools.partial(_qwen3_route, gate, x, moe, ops)
        other = functools.partial(_qwen3_route, functools.partial(F.linear, weight=w), x, moe,
                                  None)
        check_same("qwen3 router weights", mine()[0].sort(dim=1)[0], other()[0].sort(dim=1)[0],
              2e-2)
        rows.append(_row("qwen3_router", f"B{b} E{s.qwen3_experts}", mine, other, s, flush))
    return rows


def _qwen3_route(gate: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, moe: MoeConfig,
                 ops) -> tuple[torch.Tensor, torch.Tensor]:
    return route(gate(x), moe, ops=ops)


def _row(op: str, case: str, mine: Callable[[], object], other: Callable[[], object],
         s: MoeOpsSettings, flush: torch.Tensor) -> OpRow:
    return OpRow(op, case, cold_median_us(other, s.repeats, flush),
                 cold_median_us(mine, s.repeats, flush))


def run(s: MoeOpsSettings, ops) -> list[OpRow]:
    flush = torch.empty(FLUSH_BYTES // 4)
    cfg = _deepseek_config(s)
    with torch.inference_mode():
        return (mla_rows(ModelConfig.from_hf_dict(cfg), ops, s, flush)
                + router_rows(cfg, ops, s, flush) + qwen3_rows(ops, s, flush))


def format_table(rows: list[OpRow]) -> str:
    head = f"{'op':<14}{'case':<14}{'PyTorch us':>12}{'operators us':>14}{'x PyTorch':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.op:<14}{r.case:<14}{r.pytorch_us:>12.1f}{r.operators_us:>14.1f}"
                     f"{r.speedup:>11.2f}")
    return "\n".join(lines)


def main(s: MoeOpsSettings, as_json: bool) -> int:
    ops = cpu_ops()
    if ops is None:
        print("pdserve bench moe-ops: the compiled CPU operators are not available here (they "
              "need a C++ compiler)", file=sys.stderr)
        return 1
    print(f"hidden {s.hidden}, {s.heads} MLA heads of rank {s.kv_lora_rank}, "
          f"{torch.get_num_threads()} threads, medians of {s.repeats} calls after a cache "
          f"flush", file=sys.stderr)
    rows = run(s, ops)
    if as_json:
        for r in rows:
            print(json.dumps({"kind": "moe_op"} | asdict(r) | {"speedup": round(r.speedup, 3)}))
    else:
        print(format_table(rows))
    return 0
