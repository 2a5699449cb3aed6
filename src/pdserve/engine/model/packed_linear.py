"""CPU linear layers with their weights reordered once, at load time, for the kernel that runs
them.

- `KernelLinear`: bf16 through one of pdserve's own kernels, the first this CPU has:
  - "amx" (`kernels/csrc/amx_linear.cpp`, Intel AMX tiles): SmolLM2's decode step streams its
    weights 1.3-1.6x faster than through oneDNN at batch 1-32, and a 1,000-token prefill's
    matmuls run ~1.25x faster (Xeon with AMX, all of its linears, 2 threads, batch 1:
    17.3 ms -> 10.6 ms);
  - "avx512_bf16" (`kernels/csrc/dpbf16_linear.cpp`, VDPBF16PS, e.g. AMD Zen 4): all of
    SmolLM2's linears 1.5x faster than oneDNN at batch 1-8 (29 against 19 GB/s of weights),
    1.2x at 32 (358 against 302 GFLOP/s), the same at 1,000 rows (EPYC Zen 4, 2 threads).
  Every kernel weight of a model lives in one mapping on huge pages (`engine/huge_pages.py`).
- `PackedLinear` otherwise: the weight reordered into oneDNN's blocked layout (what PyTorch's
  inductor does when it freezes a CPU graph); `F.linear` hands oneDNN a plain [out, in] weight
  every call, 1.3-2x slower here, with bit-identical results in fp32 and bf16.
- a plain nn.Linear where oneDNN has no path for the dtype on this CPU (bf16 or fp16 without
  AVX-512 or the AVX-NE-CONVERT conversions, e.g. an AVX2-only Zen 2/3 or Haswell core: oneDNN
  refuses to reorder such a weight); PyTorch's own kernels then run it, slowly but exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from pdserve.engine import huge_pages


@dataclass(frozen=True)
class LinearKernel:
    """One of pdserve's bf16 linear kernels: `pack` reorders an [out, in] weight once, `run`
    computes x [T, in] . weight^T (+ fp32 bias) -> [T, out] from it. A layer fits when out and
    in are multiples of `out_multiple` and `in_multiple`."""

    name: str
    pack: Callable[[torch.Tensor], torch.Tensor]
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    out_multiple: int
    in_multiple: int

    def fits(self, linear: nn.Linear) -> bool:
        return (linear.weight.dtype == torch.bfloat16
                and linear.out_features % self.out_multiple == 0
                and linear.in_features % self.in_multiple == 0)


def available_kernels(ops: ModuleType | None) -> list[LinearKernel]:
    """pdserve's linear kernels that this CPU runs, fastest first."""
    if ops is None:
        return []
    kernels = [(ops.amx_available(), LinearKernel("amx", ops.amx_pack, ops.amx_linear, 32, 32)),
               (ops.dpbf16_available(), LinearKernel("avx512_bf16", ops.dpbf16_pack,
                                                     ops.dpbf16_linear, 16, 2)),
               (ops.avx2_available(), LinearKernel("avx2", ops.avx2_pack, ops.avx2_linear, 16,
                                                   1))]
    return [kernel for available, kernel in kernels if available]


def linear_kernel(ops: ModuleType | None) -> LinearKernel | None:
    """The fastest of pdserve's linear kernels that this CPU runs, or None (oneDNN then)."""
    return next(iter(available_kernels(ops)), None)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, in] -> [T, out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class KernelLinear(nn.Module):
    """`packed`: the weight in `kernel`'s layout."""

    def __init__(self, linear: nn.Linear, kernel: LinearKernel, packed: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel
        self.packed = packed
        # fp32 once here: the kernel adds the bias to its fp32 sums (else a cast every call)
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, in] -> [T, out]
        return self.kernel.run(x, self.packed, self.bias)


def can_pack(device: str) -> bool:
    return device == "cpu" and torch.backends.mkldnn.is_available()


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN has a path for `dtype` weights on this CPU (PackedLinear)."""
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return True


def pack_linears(module: nn.Module, ops: ModuleType | None = None) -> None:
    """Replace every nn.Linear under `module` (weights are copied): by a KernelLinear where
    `ops` (pdserve's compiled CPU operators) has a linear kernel for this CPU and the shape
    fits, else a PackedLinear where oneDNN runs the dtype here (else it stays). The kernel
    weights are packed side by side into one huge-page mapping."""
    kernel = linear_kernel(ops)
    linears = [(parent, name, child, kernel is not None and kernel.fits(child))
               for parent in module.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    numel = sum(lin.weight.numel() for _, _, lin, fits in linears if fits)
    arena = huge_pages.zeros((numel,), torch.bfloat16)
    offset = 0
    for parent, name, lin, fits in linears:
        if not fits:
            if onednn_packs(lin.weight.dtype):
                setattr(parent, name, PackedLinear(lin))
            continue
        packed_weight = kernel.pack(lin.weight.detach())  # 64-byte multiples: stays aligned
        packed = arena[offset : offset + packed_weight.numel()].view(packed_weight.shape)
        packed.copy_(packed_weight)
        offset += packed_weight.numel()
        setattr(parent, name, KernelLinear(lin, kernel, packed))
