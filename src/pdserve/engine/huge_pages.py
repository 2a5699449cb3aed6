"""CPU tensors on transparent huge pages (2 MiB), for the memory a decode step sweeps: the
packed weights and the KV pool.

Why: with 4 KiB pages every 64 cache lines cost a TLB miss and a page walk. The weights are
streamed in full each step; the KV pool is read a block at a time, at random places. Where
THP is in `madvise` mode (a common distribution default; this machine's), PyTorch's own
allocations never get huge pages. Measured here (2 threads, one process each, medians):
SmolLM2's AMX linears 14.4 -> 11.5 ms at batch 1 and 24.1 -> 15.3 ms at batch 32; decode
attention, 32 requests x 480 tokens at random blocks, 1,360 -> 970 us a layer.

Lifetime: a tensor from here views an anonymous private mapping, which lives as long as any
tensor viewing it (`torch.frombuffer` holds the mapping). Every page is written once at
creation, so the memory is taken then, as `torch.zeros` would take it. Where the advice is
refused (THP `never`, other systems) the memory is still correct, only on small pages.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor starting on a huge-page boundary."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype)
    # one page of slack so the tensor can start on a 2 MiB boundary (the slack is never touched)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # THP disabled: small pages
        mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping`
    start = -raw.data_ptr() % HUGE_PAGE
    out = raw[start : start + nbytes].view(dtype).view(shape)
    out.zero_()  # fault every page in now (anonymous memory reads as zero already)
    return out
