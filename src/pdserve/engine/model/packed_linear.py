"""CPU linear layers with weights reordered once into oneDNN's blocked layout.

`F.linear` on CPU hands oneDNN a plain [out, in] weight every call; prepacking it at load time
(what PyTorch's inductor does when it freezes a CPU graph) streams SmolLM2's decode weights
1.3-2x faster at batch 1-32 here, with bit-identical results in fp32 and bf16 (measured on
this machine: e.g. 49152x576 bf16 at batch 8, 2.26 ms -> 1.32 ms).
"""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, in] -> [T, out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(device: str) -> bool:
    return device == "cpu" and torch.backends.mkldnn.is_available()


def pack_linears(module: nn.Module) -> None:
    """Replace every nn.Linear under `module` by a PackedLinear (weights are copied)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child))
        else:
            pack_linears(child)
