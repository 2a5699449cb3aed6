"""Row-parallel outputs: each rank's partial result, summed over the ranks.

A rank's o_proj sees only its heads' attention outputs, a dense MLP's down_proj only its
columns, a MoE block (routed and shared experts) only its columns of every expert: each
output is a partial sum of the full layer's, and one all-reduce each makes every rank's
hidden state the full one. So a layer sums twice: after o_proj, and after down_proj or the
whole MoE block (once, not once per expert: the weighted sum over the chosen experts is
linear in their partial outputs). A linear's bias (DeepSeek's o_proj with attention_bias) is
added once, after the sum.

The wrapper is not a `KernelLinear`, so a tensor-parallel model runs its decode steps through
the Python layers, never the compiled one-call decode layer (which has no all-reduce between
its operators); the compiled operators inside the layers still run.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from pdserve.engine.model.llama import MLP


class AllReduce(Protocol):
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...


class RowParallel(nn.Module):
    """`module`'s output summed over the ranks, then `bias` (if any) added."""

    def __init__(self, module: nn.Module, collective: AllReduce,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.module = module
        self.collective = collective
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, in / N] (a MoE block: [T, hidden]) -> [T, out], summed over the ranks
        out = self.collective.all_reduce(self.module(x).contiguous())
        return out if self.bias is None else out.add_(self.bias)


def make_row_parallel(model: nn.Module, collective: AllReduce) -> None:
    """Sum every layer's o_proj and its MLP's output: a dense MLP's down_proj, any other MLP
    block (MoE) as a whole. After any packing of the linears."""
    for layer in model.layers:
        attn = layer.self_attn
        attn.o_proj = _row_parallel_linear(attn.o_proj, collective)
        if isinstance(layer.mlp, MLP):
            layer.mlp.down_proj = _row_parallel_linear(layer.mlp.down_proj, collective)
        else:
            layer.mlp = RowParallel(layer.mlp, collective)


def _row_parallel_linear(linear: nn.Module, collective: AllReduce) -> RowParallel:
    """`linear` (nn.Linear or a packed one) without its bias, which the sum adds once."""
    bias, linear.bias = linear.bias, None
    return RowParallel(linear, collective, bias)
