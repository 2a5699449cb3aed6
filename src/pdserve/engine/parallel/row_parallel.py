"""Row-parallel linears: each rank's partial product, summed over the ranks.

o_proj and down_proj of a rank see only its heads' and MLP columns' inputs; their outputs are
partial sums of the full layer's, and one all-reduce each makes every rank's hidden state the
full one. The wrapper is not a `KernelLinear`, so a tensor-parallel model runs its decode
steps through the Python layers, never the compiled one-call decode layer (which has no
all-reduce between its operators); the compiled operators inside the layers still run.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class AllReduce(Protocol):
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...


class RowParallelLinear(nn.Module):
    def __init__(self, linear: nn.Module, collective: AllReduce) -> None:
        super().__init__()
        self.linear = linear
        self.collective = collective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, in / N] -> [T, out], summed over the ranks
        return self.collective.all_reduce(self.linear(x).contiguous())


def make_row_parallel(model: nn.Module, collective: AllReduce) -> None:
    """Wrap every layer's o_proj and down_proj (after any packing of the linears)."""
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(attn.o_proj, collective)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, collective)
