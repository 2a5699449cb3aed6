"""CPU linear layers with their weights reordered once, at load time, for the kernel that runs
them.

- `AmxLinear`: bf16 on a CPU with AMX, through pdserve's own tile kernel
  (`kernels/csrc/amx_linear.cpp`): SmolLM2's decode step streams its weights 1.3-1.6x faster
  than through oneDNN at batch 1-32, and a 1,000-token prefill's matmuls run ~1.25x faster
  (measured on this machine: all of its linears, 2 threads, batch 1: 17.3 ms -> 10.6 ms).
  Every AMX weight of a model lives in one mapping on huge pages (`engine/huge_pages.py`).
- `PackedLinear` otherwise: the weight reordered into oneDNN's blocked layout (what PyTorch's
  inductor does when it freezes a CPU graph); `F.linear` hands oneDNN a plain [out, in] weight
  every call, 1.3-2x slower here, with bit-identical results in fp32 and bf16.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from pdserve.engine import huge_pages


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, in] -> [T, out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class AmxLinear(nn.Module):
    """`packed`: the weight as AMX tiles [out/16, in/32, 16, 16, 2] (`amx_pack`'s layout);
    out and in are multiples of 32."""

    def __init__(self, linear: nn.Linear, ops: ModuleType, packed: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.ops = ops
        self.packed = packed
        # fp32 once here: the kernel adds the bias to its fp32 sums (else a cast every call)
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, in] -> [T, out]
        return self.ops.amx_linear(x, self.packed, self.bias)


def can_pack(device: str) -> bool:
    return device == "cpu" and torch.backends.mkldnn.is_available()


def _fits_amx(linear: nn.Linear, ops: ModuleType | None) -> bool:
    return (ops is not None and ops.amx_available() and linear.weight.dtype == torch.bfloat16
            and linear.in_features % 32 == 0 and linear.out_features % 32 == 0)


def pack_linears(module: nn.Module, ops: ModuleType | None = None) -> None:
    """Replace every nn.Linear under `module` (weights are copied): by an AmxLinear where `ops`
    (pdserve's compiled CPU operators) has AMX here and the shape fits, else a PackedLinear.
    The AMX weights are packed side by side into one huge-page mapping."""
    linears = [(parent, name, child, _fits_amx(child, ops)) for parent in module.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    amx_numel = sum(lin.weight.numel() for _, _, lin, amx in linears if amx)
    arena = huge_pages.zeros((amx_numel,), torch.bfloat16)
    offset = 0
    for parent, name, lin, amx in linears:
        if not amx:
            setattr(parent, name, PackedLinear(lin))
            continue
        tiles = ops.amx_pack(lin.weight.detach())  # sizes a multiple of 1 KiB: stays aligned
        packed = arena[offset : offset + tiles.numel()].view(tiles.shape)
        packed.copy_(tiles)
        offset += tiles.numel()
        setattr(parent, name, AmxLinear(lin, ops, packed))
