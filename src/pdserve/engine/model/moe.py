"""Routed SwiGLU experts with stacked weights; only the experts some token chose are computed.

Layout as transformers 5 keeps it in memory (`Qwen3MoeExperts`, `DeepseekV3Experts`):
`gate_up_proj [E, 2I, hidden]` (gate rows, then up rows) and `down_proj [E, hidden, I]`.
Checkpoints store one module per expert; `stack_expert_weights` builds this layout. A bf16
model on CPU runs them as `packed_experts.PackedExperts` (the grouping and sums of
`run_chosen_experts` in one compiled call, on pdserve's linear kernels).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    """E experts of width I. `forward` groups the (token, slot) pairs by expert and runs two
    matmuls per chosen expert; an unchosen expert's weights are never read."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.inter = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size))  # [E, 2I, hidden]
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size))  # [E, hidden, I]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], topk_ids [T, k] (long), topk_weights [T, k] -> [T, hidden]."""
        return run_chosen_experts(x, topk_ids, topk_weights, self.num_experts, self._grouped)

    def _grouped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ys = torch.empty_like(xs)  # [S, hidden]
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                gate, up = F.linear(xs[start : start + n], self.gate_up_proj[e]).split(
                    self.inter, dim=-1)  # [n, I] each
                ys[start : start + n] = F.linear(F.silu(gate) * up, self.down_proj[e])
                start += n
        return ys


def run_chosen_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       num_experts: int,
                       grouped: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                       ) -> torch.Tensor:
    """x [T, hidden], topk_ids [T, k] (long), topk_weights [T, k] -> [T, hidden]: the
    (token, slot) pairs grouped by expert and `grouped(xs [T*k, hidden], counts [E] int64)
    -> [T*k, hidden]` called once, xs holding each expert's rows in expert order (counts[e] of
    them) and returning each row's expert output; an unchosen expert must not be read.

    Sums like transformers' default ("grouped_mm") experts: each slot's output times its
    weight (in the promoted dtype: fp32 for DeepSeek's fp32 weights), then the k slots of a
    token summed in slot order, then cast to x's dtype."""
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    order = flat_ids.argsort(stable=True)  # [T*k]: slots grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts)  # [E]
    ys = grouped(x[order // k], counts)  # [T*k, hidden], in expert order
    weighted = ys * topk_weights.reshape(-1)[order, None]  # [T*k, hidden]
    slots = torch.empty_like(weighted)
    slots[order] = weighted  # back to (token, slot) order
    return slots.view(t, k, x.shape[1]).sum(dim=1).to(x.dtype)  # [T, hidden]


def stack_expert_weights(weights: dict[str, torch.Tensor], prefix: str,
                         num_experts: int) -> dict[str, torch.Tensor]:
    """`{prefix}gate_up_proj` [E, 2I, hidden] and `{prefix}down_proj` [E, hidden, I] from
    either checkpoint layout under `prefix` (e.g. "layers.3.mlp.experts."): per expert
    (`{prefix}{e}.gate_proj.weight`, `up_proj`, `down_proj`; what checkpoints and transformers'
    `save_pretrained` write) or already stacked. The per-expert tensors are removed from
    `weights`; a missing expert is a ValueError."""
    fused = f"{prefix}gate_up_proj", f"{prefix}down_proj"
    if all(name in weights for name in fused):
        return {name: weights.pop(name) for name in fused}
    gate_up, down = [], []
    for e in range(num_experts):
        names = [f"{prefix}{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
        absent = [n for n in names if n not in weights]
        if absent:
            raise ValueError(f"weights are missing expert tensor(s) {absent[:3]}")
        gate, up, dn = (weights.pop(n) for n in names)
        gate_up.append(torch.cat([gate, up], dim=0))  # [2I, hidden]
        down.append(dn)  # [hidden, I]
    return {fused[0]: torch.stack(gate_up), fused[1]: torch.stack(down)}
