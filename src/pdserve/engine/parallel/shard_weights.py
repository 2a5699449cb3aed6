"""One rank's slices of a Llama-family checkpoint: the full tensors are read, then narrowed.

Column-parallel (output rows of [out, in]): q_proj by the rank's query heads, k_proj and v_proj
by its KV heads (biases alike), gate_proj and up_proj by its MLP columns. Row-parallel (input
columns): o_proj by its query heads, down_proj by its MLP columns; their partial products are
summed over the ranks (`row_parallel.py`), so they carry no bias (none of these models has
one). Every other tensor (embedding, norms, LM head) is whole on every rank.
"""

from __future__ import annotations

import re

import torch

from pdserve.engine.parallel.shard_plan import ShardPlan

_NAME = re.compile(r"layers\.\d+\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.(weight|bias)$")


def shard_weights(weights: dict[str, torch.Tensor], plan: ShardPlan,
                  head_dim: int) -> dict[str, torch.Tensor]:
    """`weights` (HF names) with every split tensor narrowed to `plan`'s share (views)."""
    out = {}
    for name, tensor in weights.items():
        m = _NAME.search(name)
        out[name] = tensor if m is None else _narrow(tensor, m[1], m[2], plan, head_dim)
    return out


def _narrow(t: torch.Tensor, proj: str, kind: str, plan: ShardPlan, d: int) -> torch.Tensor:
    if proj in ("o", "down") and kind == "bias":
        raise ValueError(f"a {proj}_proj bias cannot be split over ranks (it would be added "
                         f"once per rank)")
    span = {"q": plan.q_heads, "o": plan.q_heads, "k": plan.kv_heads, "v": plan.kv_heads,
            "gate": plan.mlp_columns, "up": plan.mlp_columns, "down": plan.mlp_columns}[proj]
    scale = d if proj in ("q", "o", "k", "v") else 1  # heads are head_dim rows each
    dim = 1 if proj in ("o", "down") else 0
    return t.narrow(dim, span.start * scale, len(span) * scale)
