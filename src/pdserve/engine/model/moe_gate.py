"""Which experts each token goes to, and with what weight.

Each rule is written with the same tensor operations, in the same order, as transformers 5.24
(`Qwen3MoeTopKRouter`, `DeepseekV2TopkRouter`, `DeepseekV3TopkRouter`), so on the same
logits the chosen ids, their slot order and the weights are the same (ties included). On the
compiled CPU operators (a bf16 model on CPU) noaux_tc (~25 operator calls here) and softmax
top-k (5) are one call each (`noaux_tc_route`, `softmax_topk_route`): the same choice and
weights to fp32 rounding, best first, ties to the lower expert id.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.common.moe_config import MoeConfig


def softmax_topk(logits: torch.Tensor, top_k: int,
                 norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE (and Mixtral, Qwen2-MoE): softmax over all experts in fp32, the k largest
    (sorted), renormalised to sum 1 if `norm_topk_prob`, cast to the logits' dtype.
    logits [T, E] -> (weights [T, k], ids [T, k])."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """group_scores [T, G] -> bool [T, E]: the experts of each token's `topk_group` best
    groups (experts numbered group by group)."""
    t, groups = group_scores.shape
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]  # [T, g]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, G]
    return (group_mask.unsqueeze(-1).expand(t, groups, num_experts // groups)
            .reshape(t, num_experts).bool())  # [T, E]


def greedy(scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 `greedy` (DeepSeek-V2-Lite): the k best softmax scores.
    scores [T, E] -> (weights [T, k], ids [T, k]), unscaled."""
    return torch.topk(scores, k=top_k, dim=-1, sorted=False)


def group_limited_greedy(scores: torch.Tensor, top_k: int, n_group: int,
                         topk_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 device-limited routing (arXiv 2405.04434, section 2.2.2): a group's score
    is its best expert's; the k best experts within the `topk_group` best groups (the others
    scored 0, as transformers does). scores [T, E] -> (weights, ids) [T, k], unscaled."""
    t, e = scores.shape
    group_scores = scores.view(t, n_group, e // n_group).max(dim=-1).values  # [T, G]
    keep = _group_mask(group_scores, topk_group, e)  # [T, E]
    return torch.topk(scores.masked_fill(~keep, 0.0), k=top_k, dim=-1, sorted=False)


def noaux_tc(scores: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
             topk_group: int, norm_topk_prob: bool,
             scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 auxiliary-loss-free routing (arXiv 2412.19437, section 2.1.2): sigmoid
    scores plus the learnt `e_score_correction_bias` decide the choice only; a group's score
    is the sum of its two best biased scores; the k best biased scores within the
    `topk_group` best groups; weights are the unbiased scores of the chosen, divided by their
    sum (+1e-20) if `norm_topk_prob`, times `scaling`.
    scores [T, E] (sigmoid, fp32), bias [E] -> (weights, ids) [T, k]."""
    t, e = scores.shape
    biased = scores + bias  # [T, E]
    group_scores = biased.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T,G]
    keep = _group_mask(group_scores, topk_group, e)  # [T, E]
    ids = torch.topk(biased.masked_fill(~keep, float("-inf")), k=top_k, dim=-1,
                     sorted=False)[1]  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def route(logits: torch.Tensor, cfg: MoeConfig, bias: torch.Tensor | None = None,
          ops: ModuleType | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k], ids [T, k] long) by `cfg`'s rule; `bias` is
    DeepSeek-V3's `e_score_correction_bias` [E] (fp32); `ops`: the compiled CPU operators, or
    None."""
    on_ops = ops is not None and logits.device.type == "cpu"
    if not cfg.gate_fp32:
        if on_ops:
            return ops.softmax_topk_route(logits.contiguous(), cfg.top_k, cfg.norm_topk_prob)
        return softmax_topk(logits, cfg.top_k, cfg.norm_topk_prob)
    if cfg.topk_method == "noaux_tc":
        if bias is None:
            raise ValueError("noaux_tc routing needs e_score_correction_bias")
        if on_ops:
            return ops.noaux_tc_route(logits, bias.float(), cfg.top_k, cfg.n_group,
                                      cfg.topk_group, cfg.norm_topk_prob,
                                      cfg.routed_scaling_factor)
        return noaux_tc(logits.sigmoid(), bias.float(), cfg.top_k, cfg.n_group, cfg.topk_group,
                        cfg.norm_topk_prob, cfg.routed_scaling_factor)
    scores = logits.softmax(dim=-1, dtype=torch.float32)  # [T, E]
    if cfg.topk_method == "greedy":
        weights, ids = greedy(scores, cfg.top_k)
    else:
        weights, ids = group_limited_greedy(scores, cfg.top_k, cfg.n_group, cfg.topk_group)
    return weights * cfg.routed_scaling_factor, ids


class Router(nn.Module):
    """DeepSeek's gate: `weight [E, hidden]` and, for noaux_tc, `e_score_correction_bias [E]`
    (HF names); the logits are computed in fp32 (`cfg.gate_fp32`, as transformers keeps this
    router). `ops`: the compiled CPU operators (`router_logits`, `route`), or None. Qwen3-MoE's
    gate is a plain linear layer (`qwen3.SparseMoeBlock`), so that it is packed for the linear
    kernels with the model's other linears."""

    def __init__(self, hidden_size: int, cfg: MoeConfig, ops: ModuleType | None = None) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size))  # [E, hidden]
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.empty(cfg.num_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k], ids [T, k])."""
        if self.ops is not None and x.device.type == "cpu":
            logits = self.ops.router_logits(x, self.weight)  # [T, E] fp32
        else:
            logits = F.linear(x.float(), self.weight.float())  # [T, E] fp32
        return route(logits, self.cfg, self.e_score_correction_bias, self.ops)
