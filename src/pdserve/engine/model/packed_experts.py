"""Routed experts with each expert's weights reordered once, at load time, for one of pdserve's
bf16 linear kernels (`packed_linear.LinearKernel`: AMX tiles or AVX512-BF16's VDPBF16PS), the
way `pack_linears` does for nn.Linear.

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

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine import huge_pages
from pdserve.engine.model.moe import Experts, run_chosen_experts
from pdserve.engine.model.packed_linear import LinearKernel


def _fits(experts: Experts, kernel: LinearKernel) -> bool:
    """Both of an expert's matrices have kernel-sized sides and the weights are bf16."""
    _, two_inter, hidden = experts.gate_up_proj.shape
    sides_ok = all(n % kernel.out_multiple == 0 and k % kernel.in_multiple == 0
                   for n, k in ((two_inter, hidden), (hidden, experts.inter)))
    return sides_ok and experts.gate_up_proj.dtype == torch.bfloat16


class PackedExperts(nn.Module):
    """`Experts.forward`'s interface and grouping; each chosen expert's two products run on
    `kernel` from its packed weights (`gate_up[e]`, `down[e]`: views into one mapping)."""

    def __init__(self, experts: Experts, kernel: LinearKernel) -> None:
        super().__init__()
        self.num_experts, self.inter, self.kernel = experts.num_experts, experts.inter, kernel
        pieces = [kernel.pack(w[e].detach()) for e in range(self.num_experts)
                  for w in (experts.gate_up_proj, experts.down_proj)]
        arena = huge_pages.zeros((sum(p.numel() for p in pieces),), torch.bfloat16)
        views, offset = [], 0
        for piece in pieces:
            views.append(arena[offset : offset + piece.numel()].view(piece.shape).copy_(piece))
            offset += piece.numel()
        self.gate_up, self.down = views[0::2], views[1::2]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], topk_ids [T, k] (long), topk_weights [T, k] -> [T, hidden]."""
        return run_chosen_experts(x, topk_ids, topk_weights, self.num_experts, self._expert)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.kernel.run(x, self.gate_up[e], None).split(self.inter, dim=-1)
        return self.kernel.run(F.silu(gate) * up, self.down[e], None)  # [n, hidden]


def pack_experts(module: nn.Module, kernel: LinearKernel | None) -> None:
    """Replace every loaded bf16 `Experts` under `module` whose shapes fit `kernel` by a
    `PackedExperts` (the others, and every one when `kernel` is None, stay as they are)."""
    if kernel is None:
        return
    found = [(parent, name, child) for parent in module.modules()
             for name, child in parent.named_children() if isinstance(child, Experts)]
    for parent, name, child in found:
        if _fits(child, kernel):
            setattr(parent, name, PackedExperts(child, kernel))
