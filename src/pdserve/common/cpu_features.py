"""What this CPU computes natively, read from /proc/cpuinfo (torch-free: the CLI resolves
`--dtype auto` before any engine loads).

bf16 arithmetic: oneDNN, which runs PyTorch's CPU matmuls, has a bf16 path only with AVX-512
(BW, VL and DQ), AVX-NE-CONVERT, AMX or Arm's BF16 (the conditions of PyTorch's
`torch.ops.mkldnn._is_mkldnn_bf16_supported`). Elsewhere, e.g. an AVX2-only Zen 2/3 or Haswell
core, PyTorch emulates bf16: measured on a 2-core AVX2 EPYC, a 1,024^3 matmul ran at 0.6
GFLOP/s in bf16 against 29 in fp32. End to end (`pdserve bench engine --dtype float32` against
`--dtype bfloat16`, SmolLM2, same machine): a 128-token prefill 159 against 25 tokens/s (6.3x),
decode at batch 8 48 against 24 (2.0x); only decode at batch 1, which reads the weights and
hardly computes, is faster in bf16 (13.0 against 8.4: half the bytes). A server batches and
prefills, so it serves faster in float32.
"""

from __future__ import annotations

import functools
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
_X86_AVX512 = frozenset({"avx512bw", "avx512vl", "avx512dq"})
_OTHER_BF16 = frozenset({"avx_ne_convert", "amx_bf16", "bf16"})  # x86 NE/AMX; Arm "bf16"


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The first CPU's feature flags (x86 "flags", Arm "Features"); None where unreadable."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def cpu_computes_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU has a native bf16 path (module docstring); True where its flags
    cannot be read (no worse than naming bfloat16 outright)."""
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return True
    return flags >= _X86_AVX512 or bool(_OTHER_BF16 & flags)
