"""One rank's slices of a checkpoint: the full tensors are read, then narrowed.

Each split tensor is known by its HF name (`_SPLITS`, the layer and expert indices left out)
and narrowed along one dimension to the rank's share (`ShardPlan`) times a unit width:
- column-parallel (output rows, biases alike): q_proj and MLA's q_b_proj by query heads of
  head_dim (MLA: qk_head_dim, nope then rope), k_proj and v_proj by KV heads, MLA's kv_b_proj
  by query heads of qk_nope_head_dim + v_head_dim (the rank's heads' key and value halves, as
  the absorbed decode splits them), gate_proj and up_proj by MLP columns (a routed expert's by
  the expert columns, the shared experts' by the shared columns);
- row-parallel (input columns): o_proj by query heads of head_dim (MLA: v_head_dim),
  down_proj by the columns of its gate/up. Their partial products are summed over the ranks
  (`row_parallel.py`); a bias of theirs (DeepSeek's o_proj with attention_bias) stays whole
  and is added once, after the sum.
- stacked experts (`experts.gate_up_proj [E, 2I, hidden]`, `experts.down_proj [E, hidden,
  I]`): each expert's gate rows and up rows, and down columns, by the expert columns.
Every other tensor is whole on every rank: the embedding, the norms (Qwen3's q/k norms are per
head_dim, shared by the heads), the LM head, MLA's q_a_proj, kv_a_proj_with_mqa and their
norms (the latent is not split), and the routers (every rank routes alike).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.common.model_config import ModelConfig
from pdserve.engine.parallel.shard_plan import ShardPlan

# layers.{i}.{module}[.weight|.bias], with any "experts.{e}." written "experts.*."
_NAME = re.compile(r"layers\.\d+\.(?P<module>[\w.]+?)(?:\.(?P<kind>weight|bias))?$")
_EXPERT = re.compile(r"experts\.\d+\.")


def _head_dim(cfg: ModelConfig) -> int:
    return cfg.head_dim  # MLA: qk_head_dim


def _o_width(cfg: ModelConfig) -> int:
    return cfg.head_dim if cfg.mla is None else cfg.mla.v_head_dim


def _kv_b_width(cfg: ModelConfig) -> int:
    return cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim


def _column(cfg: ModelConfig) -> int:
    return 1


@dataclass(frozen=True)
class _Split:
    share: str  # the `ShardPlan` field
    dim: int  # the dimension narrowed
    unit: Callable[[ModelConfig], int]  # rows or columns per unit of the share
    row_parallel: bool = False  # input columns: a bias of it stays whole
    pieces: int = 1  # gate|up stacked: each half narrowed alike


_SPLITS = {
    "self_attn.q_proj": _Split("q_heads", 0, _head_dim),
    "self_attn.q_b_proj": _Split("q_heads", 0, _head_dim),
    "self_attn.k_proj": _Split("kv_heads", 0, _head_dim),
    "self_attn.v_proj": _Split("kv_heads", 0, _head_dim),
    "self_attn.kv_b_proj": _Split("q_heads", 0, _kv_b_width),
    "self_attn.o_proj": _Split("q_heads", 1, _o_width, row_parallel=True),
    "mlp.gate_proj": _Split("mlp_columns", 0, _column),
    "mlp.up_proj": _Split("mlp_columns", 0, _column),
    "mlp.down_proj": _Split("mlp_columns", 1, _column, row_parallel=True),
    "mlp.experts.*.gate_proj": _Split("expert_columns", 0, _column),
    "mlp.experts.*.up_proj": _Split("expert_columns", 0, _column),
    "mlp.experts.*.down_proj": _Split("expert_columns", 1, _column, row_parallel=True),
    "mlp.experts.gate_up_proj": _Split("expert_columns", 1, _column, pieces=2),
    "mlp.experts.down_proj": _Split("expert_columns", 2, _column, row_parallel=True),
    "mlp.shared_experts.gate_proj": _Split("shared_columns", 0, _column),
    "mlp.shared_experts.up_proj": _Split("shared_columns", 0, _column),
    "mlp.shared_experts.gate_up_proj": _Split("shared_columns", 0, _column, pieces=2),
    "mlp.shared_experts.down_proj": _Split("shared_columns", 1, _column, row_parallel=True),
}


def shard_weights(weights: dict[str, torch.Tensor], plan: ShardPlan,
                  cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """`weights` (HF names, of the model `cfg`) with every split tensor narrowed to `plan`'s
    share (views, except a stacked gate|up)."""
    out = {}
    for name, tensor in weights.items():
        split, kind = _split(name)
        whole = split is None or (kind == "bias" and split.row_parallel)
        out[name] = tensor if whole else _narrow(tensor, split, plan, cfg)
    return out


def _split(name: str) -> tuple[_Split | None, str | None]:
    m = _NAME.search(name)
    if m is None:
        return None, None
    return _SPLITS.get(_EXPERT.sub("experts.*.", m["module"])), m["kind"]


def _narrow(t: torch.Tensor, split: _Split, plan: ShardPlan, cfg: ModelConfig) -> torch.Tensor:
    span, unit = getattr(plan, split.share), split.unit(cfg)
    piece = t.shape[split.dim] // split.pieces
    parts = [t.narrow(split.dim, p * piece + span.start * unit, len(span) * unit)
             for p in range(split.pieces)]
    return parts[0] if split.pieces == 1 else torch.cat(parts, dim=split.dim)
