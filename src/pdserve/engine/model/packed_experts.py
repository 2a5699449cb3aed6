"""Routed experts with each expert's weights reordered once, at load time, for one of pdserve's
bf16 linear kernels (`packed_linear.LinearKernel`: AMX tiles, AVX512-BF16's VDPBF16PS, or AVX2
FMAs), the way `pack_linears` does for nn.Linear.

Why: PyTorch runs a bf16 [n, hidden] x [2I, hidden]^T product on a plain (unpacked) weight well
below the memory bandwidth at decode's few rows: one expert of DeepSeek-V3's shape scaled to
hidden 1024 (gate|up 1024 x 1024 and down 1024 x 512, 3.1 MB) took 0.43-0.54 ms through
F.linear against 0.16-0.20 ms through the VDPBF16PS kernel on its packed weight (EPYC Zen 4,
1 thread, 64 experts in turn so none stays in cache: 6-7 against 16-19 GB/s).

Layout: every expert's packed gate|up and down of a model side by side in one huge-page
mapping (`engine/huge_pages.py`), expert by expert, so a chosen expert is two contiguous
regions and an unchosen expert's bytes are never touched. Lifetime: built by `pack_experts`
from a loaded `Experts`, which it replaces; the mapping lives as long as the module.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from pdserve.engine import huge_pages
from pdserve.engine.model.moe import Experts
from pdserve.engine.model.packed_linear import LinearKernel, linear_kernel


def _fits(experts: Experts, kernel: LinearKernel) -> bool:
    """Both of an expert's matrices have kernel-sized sides and the weights are bf16."""
    _, two_inter, hidden = experts.gate_up_proj.shape
    sides_ok = all(n % kernel.out_multiple == 0 and k % kernel.in_multiple == 0
                   for n, k in ((two_inter, hidden), (hidden, experts.inter)))
    return sides_ok and experts.gate_up_proj.dtype == torch.bfloat16


class PackedExperts(nn.Module):
    """`Experts.forward`'s interface and sums (`run_chosen_experts`) in one call of the
    compiled `moe_experts` (csrc/moe_experts.cpp): the grouping by expert, the chosen experts
    on `kernel` from each expert's packed weights (`weights.gate_up[e]`, `weights.down[e]`:
    views into one mapping), the weighted sum over slots. An expert's activation is
    `silu_mul`, rounded to bf16 once, as in the fused Llama layer (PyTorch's
    `F.silu(gate) * up` rounds twice)."""

    def __init__(self, experts: Experts, kernel: LinearKernel, ops: ModuleType) -> None:
        super().__init__()
        self.num_experts, self.ops = experts.num_experts, ops
        pieces = [kernel.pack(w[e].detach()) for e in range(self.num_experts)
                  for w in (experts.gate_up_proj, experts.down_proj)]
        arena = huge_pages.zeros((sum(p.numel() for p in pieces),), torch.bfloat16)
        views, offset = [], 0
        for piece in pieces:
            views.append(arena[offset : offset + piece.numel()].view(piece.shape).copy_(piece))
            offset += piece.numel()
        self.weights = ops.ExpertWeights()
        self.weights.gate_up, self.weights.down = views[0::2], views[1::2]
        self.weights.kernel = kernel.name

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], topk_ids [T, k] (long), topk_weights [T, k] -> [T, hidden]."""
        return self.ops.moe_experts(x, topk_ids.contiguous(), topk_weights.contiguous(),
                                    self.weights)


def pack_experts(module: nn.Module, ops: ModuleType | None) -> None:
    """Replace every loaded bf16 `Experts` under `module` whose shapes fit the fastest of
    `ops`'s linear kernels by a `PackedExperts` (the others, and every one when `ops` has no
    kernel for this CPU or is None, stay as they are)."""
    kernel = linear_kernel(ops)
    if kernel is None:
        return
    found = [(parent, name, child) for parent in module.modules()
             for name, child in parent.named_children() if isinstance(child, Experts)]
    for parent, name, child in found:
        if _fits(child, kernel):
            setattr(parent, name, PackedExperts(child, kernel, ops))
