"""Which heads, MLP columns and expert columns each rank of a tensor-parallel engine computes.

Heads:
- GQA models (Llama, Qwen2, Mistral, Qwen3, Qwen3-MoE), as `common/head_split.py` says:
  contiguous runs of whole KV heads with their query heads, or each KV head replicated on
  N / kv_heads ranks, which split its query heads evenly.
- MLA models (DeepSeek-V2/V3): contiguous runs of query heads (runs differ by one head at
  most), and every rank keeps the whole latent: `kv_heads` is range(0, 1) on every rank, the
  one latent "head" of the pool, which every rank maps and writes with the same values (each
  computes it from the same summed hidden state).
MLP columns (dense layers) are split in contiguous runs sized so that every rank holds about
the same attention and MLP weights: a rank with fewer heads takes more columns (SmolLM2's 3 KV
heads on 2 ranks: 1 and 2 heads, 864 and 672 of 1,536 columns), since a step's linears take
time in proportion to their weights, for decode (weight reads) and prefill (FLOPs) alike.
Expert columns (MoE layers): every rank keeps every expert and the router whole, and takes
the same even run of each expert's intermediate columns; the shared experts (one SwiGLU of
n_shared_experts x moe_intermediate_size) split in the matching runs n_shared_experts times
as wide. A rank's model is the model with its own head and column counts (`local_config`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from pdserve.common.head_split import head_split_error
from pdserve.common.model_config import ModelConfig

# Decoders whose layers split as this module and `shard_weights.py` say (every architecture
# pdserve runs today; one added later runs on one process until it is listed here).
TP_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM",
                    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM",
                    "DeepseekV3ForCausalLM")
# Column runs (MLP and expert) are multiples of this many columns where the model's allow (the
# linear and packed-expert kernels' tile: a run off it would fall back to oneDNN)
MLP_GRAIN = 32


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `size` computes these global query heads, KV heads (MLA: range(0, 1),
    the whole latent), dense MLP columns and, in MoE layers, these columns of every routed
    expert and of the shared experts (empty ranges in a model without experts)."""

    rank: int
    size: int
    q_heads: range
    kv_heads: range
    mlp_columns: range
    expert_columns: range
    shared_columns: range

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` with this rank's head and column counts (head_dim, the latent and everything
        else kept)."""
        moe = None if cfg.moe is None else dataclasses.replace(
            cfg.moe, intermediate_size=len(self.expert_columns))
        return dataclasses.replace(cfg, num_heads=len(self.q_heads),
                                   num_kv_heads=len(self.kv_heads),
                                   intermediate_size=len(self.mlp_columns), moe=moe)


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """ValueError, naming the numbers, unless `cfg` splits over `size` ranks."""
    if size == 1:
        return
    if cfg.architecture not in TP_ARCHITECTURES:
        raise ValueError(f"tensor_parallel_size {size}: {cfg.architecture} runs on one process "
                         f"only for now; tensor parallelism covers {', '.join(TP_ARCHITECTURES)}")
    error = _head_error(cfg, size)
    if error is not None:
        raise ValueError(error)
    widths = [(cfg.intermediate_size, "MLP columns (intermediate_size)")]
    if cfg.moe is not None:
        widths.append((cfg.moe.intermediate_size, "expert columns (moe_intermediate_size)"))
    for width, what in widths:
        if width < size:
            raise ValueError(f"tensor_parallel_size {size} exceeds the model's {width} {what}")


def _head_error(cfg: ModelConfig, size: int) -> str | None:
    if cfg.mla is None:
        return head_split_error(size, cfg.num_heads, cfg.num_kv_heads)
    if size > cfg.num_heads:
        return (f"tensor-parallel size {size} exceeds the {cfg.num_heads} attention heads of "
                f"this {cfg.architecture}: with Multi-head Latent Attention each rank takes a "
                f"run of whole query heads (the latent is whole on every rank); choose a size "
                f"of at most {cfg.num_heads}")
    return None


def shard_plan(cfg: ModelConfig, size: int, rank: int) -> ShardPlan:
    """The share of `rank` (0 <= rank < size); `check_tensor_parallel` has passed."""
    heads = [_heads(cfg, size, r) for r in range(size)]
    q_heads, kv_heads = heads[rank]
    mlp = _runs(cfg.intermediate_size, [_attention_weights(cfg, q, kv) for q, kv in heads],
                3 * cfg.hidden_size)[rank]
    if cfg.moe is None:
        return ShardPlan(rank, size, q_heads, kv_heads, mlp, range(0), range(0))
    experts = _runs(cfg.moe.intermediate_size, [0] * size, 1)[rank]
    shared = cfg.moe.n_shared_experts
    return ShardPlan(rank, size, q_heads, kv_heads, mlp, experts,
                     range(experts.start * shared, experts.stop * shared))


def _heads(cfg: ModelConfig, size: int, rank: int) -> tuple[range, range]:
    """(query heads, KV heads) of `rank`."""
    if cfg.mla is not None:
        return range(rank * cfg.num_heads // size, (rank + 1) * cfg.num_heads // size), range(1)
    kv, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    if kv >= size:
        kv_heads = range(rank * kv // size, (rank + 1) * kv // size)
        return range(kv_heads.start * group, kv_heads.stop * group), kv_heads
    replicas = size // kv
    head, part = divmod(rank, replicas)
    width = group // replicas
    start = head * group + part * width
    return range(start, start + width), range(head, head + 1)


def _attention_weights(cfg: ModelConfig, q: range, kv: range) -> int:
    """The attention weights a rank holds beyond what every rank holds alike: q and o rows of
    its query heads and k and v rows of its KV heads; with MLA its heads' q_b_proj (or q_proj),
    kv_b_proj and o_proj rows."""
    mla = cfg.mla
    if mla is None:
        return 2 * cfg.hidden_size * cfg.head_dim * (len(q) + len(kv))
    q_in = mla.q_lora_rank or cfg.hidden_size
    per_head = (mla.qk_head_dim * q_in + (mla.qk_nope_head_dim + mla.v_head_dim)
                * mla.kv_lora_rank + mla.v_head_dim * cfg.hidden_size)
    return per_head * len(q)


def _runs(width: int, fixed: list[int], per_column: int) -> list[range]:
    """Contiguous runs of `width` columns, one a rank, each at least one grain, that even out
    the ranks' weights: rank r's `fixed[r]` plus `per_column` a column (even runs when every
    `fixed` is equal)."""
    size = len(fixed)
    share = (sum(fixed) + per_column * width) / size
    grain = MLP_GRAIN if width % MLP_GRAIN == 0 and width >= MLP_GRAIN * size else 1
    bounds, wanted = [0], 0.0
    for rank in range(size - 1):
        wanted += (share - fixed[rank]) / per_column
        cut = int(wanted / grain + 0.5) * grain
        bounds.append(min(max(cut, bounds[-1] + grain), width - (size - rank - 1) * grain))
    bounds.append(width)
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def largest_share(cfg: ModelConfig, size: int) -> ModelConfig:
    """The local config of the rank holding the most KV heads: its pool's block size bounds
    the block count every rank's pool shares (an MLA pool is the whole latent on every rank)."""
    plans = [shard_plan(cfg, size, r) for r in range(size)]
    return max(plans, key=lambda p: len(p.kv_heads)).local_config(cfg)
