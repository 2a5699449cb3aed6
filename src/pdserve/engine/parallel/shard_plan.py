"""Which heads and MLP columns each rank of a tensor-parallel engine computes.

Heads as `common/head_split.py` says: contiguous runs of whole KV heads with their query
heads, or each KV head replicated on N / kv_heads ranks, which split its query heads evenly.
MLP columns are split in contiguous runs sized so that every rank holds about the same linear
weights: a rank with fewer heads takes more columns (SmolLM2's 3 KV heads on 2 ranks: 1 and 2
heads, 864 and 672 of 1,536 columns), since a step's linears take time in proportion to their
weights, for decode (weight reads) and prefill (FLOPs) alike. A rank's model is the model
with its own head and column counts (`local_config`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from pdserve.common.head_split import head_split_error
from pdserve.common.model_config import ModelConfig

# Decoders whose layers are the plain q|k|v, o, gate|up, down of `model/llama.py`.
TP_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
# MLP runs are multiples of this many columns where the model's allow (the linear kernels'
# tile: a run off it would fall back to oneDNN)
MLP_GRAIN = 32


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `size` computes these global query heads, KV heads and MLP columns."""

    rank: int
    size: int
    q_heads: range
    kv_heads: range
    mlp_columns: range

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` with this rank's head and column counts (head_dim and everything else kept)."""
        return dataclasses.replace(cfg, num_heads=len(self.q_heads),
                                   num_kv_heads=len(self.kv_heads),
                                   intermediate_size=len(self.mlp_columns))


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """ValueError, naming the numbers, unless `cfg` splits over `size` ranks."""
    if size == 1:
        return
    if cfg.architecture not in TP_ARCHITECTURES:
        raise ValueError(f"tensor_parallel_size {size}: {cfg.architecture} runs on one process "
                         f"only for now; tensor parallelism covers {', '.join(TP_ARCHITECTURES)}")
    error = head_split_error(size, cfg.num_heads, cfg.num_kv_heads)
    if error is not None:
        raise ValueError(error)
    if cfg.intermediate_size < size:
        raise ValueError(f"tensor_parallel_size {size} exceeds the model's "
                         f"{cfg.intermediate_size} MLP columns")


def shard_plan(cfg: ModelConfig, size: int, rank: int) -> ShardPlan:
    """The share of `rank` (0 <= rank < size); `check_tensor_parallel` has passed."""
    heads = [_heads(cfg, size, r) for r in range(size)]
    q_heads, kv_heads = heads[rank]
    return ShardPlan(rank, size, q_heads, kv_heads, _mlp_runs(cfg, heads)[rank])


def _heads(cfg: ModelConfig, size: int, rank: int) -> tuple[range, range]:
    """(query heads, KV heads) of `rank`."""
    kv, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    if kv >= size:
        kv_heads = range(rank * kv // size, (rank + 1) * kv // size)
        return range(kv_heads.start * group, kv_heads.stop * group), kv_heads
    replicas = size // kv
    head, part = divmod(rank, replicas)
    width = group // replicas
    start = head * group + part * width
    return range(start, start + width), range(head, head + 1)


def _mlp_runs(cfg: ModelConfig, heads: list[tuple[range, range]]) -> list[range]:
    """Contiguous MLP column runs, each at least one grain, that even out the ranks' linear
    weights (q|k|v rows and o columns of its heads, 3 x hidden per MLP column)."""
    size, inter = len(heads), cfg.intermediate_size
    per_column = 3 * cfg.hidden_size
    attn = [2 * cfg.hidden_size * cfg.head_dim * (len(q) + len(kv)) for q, kv in heads]
    share = (sum(attn) + per_column * inter) / size
    grain = MLP_GRAIN if inter % MLP_GRAIN == 0 and inter >= MLP_GRAIN * size else 1
    bounds, wanted = [0], 0.0
    for rank in range(size - 1):
        wanted += (share - attn[rank]) / per_column
        cut = int(wanted / grain + 0.5) * grain
        bounds.append(min(max(cut, bounds[-1] + grain), inter - (size - rank - 1) * grain))
    bounds.append(inter)
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def largest_share(cfg: ModelConfig, size: int) -> ModelConfig:
    """The local config of the rank holding the most KV heads: its pool's block size bounds
    the block count every rank's pool shares."""
    plans = [shard_plan(cfg, size, r) for r in range(size)]
    return max(plans, key=lambda p: len(p.kv_heads)).local_config(cfg)
