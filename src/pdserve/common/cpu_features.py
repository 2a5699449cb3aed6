"""What this CPU computes natively, read from /proc/cpuinfo (torch-free: the CLI resolves
`--dtype auto` before any engine loads).

bf16 arithmetic: oneDNN, which runs PyTorch's CPU matmuls, has a bf16 path only with AVX-512
(BW, VL and DQ), AVX-NE-CONVERT, AMX or Arm's BF16 (the conditions of PyTorch's
`torch.ops.mkldnn._is_mkldnn_bf16_supported`). Elsewhere, e.g. an AVX2-only Zen 2/3 or Haswell
core, PyTorch emulates bf16: measured on a 2-core AVX2 EPYC, a 1,024^3 matmul ran at 0.6
GFLOP/s in bf16 against 29 in fp32, and a 128-token SmolLM2 prefill 6.3x slower than fp32.

pdserve's own AVX2 kernels (`engine/kernels/csrc/avx2_linear.cpp`: bf16 weights widened to fp32
in registers, fp32 FMAs; `prefill_attention_fma.cpp`) turn that around where the compiled
operators build (a C++ compiler is there): `pdserve bench engine` on a 2-core AVX2 EPYC (Zen 3),
SmolLM2, `--dtype bfloat16` against `--dtype float32`: decode 4.3x at batch 1, 3.0x at 8, 1.8x
at 32 (half the weight bytes, and one compiled call per layer), prefill 1.1-1.3x at 512-2,048
tokens, and half the KV bytes to hold and to move.
"""
from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
_X86_AVX512 = frozenset({"avx512bw", "avx512vl", "avx512dq"})
_OTHER_BF16 = frozenset({"avx_ne_convert", "amx_bf16", "bf16"})  # x86 NE/AMX; Arm "bf16"
_AVX2_FMA = frozenset({"avx2", "fma"})


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


def cpu_has_avx2_fma(flags: frozenset[str] | None = None) -> bool:
    """Whether pdserve's AVX2 linear kernel runs here (AVX2 and FMA; False where unreadable)."""
    flags = cpu_flags() if flags is None else flags
    return flags is not None and flags >= _AVX2_FMA


def compiler_present() -> bool:
    """Whether the C++ compiler that builds the CPU operators is on PATH (torch's
    cpp_extension runs $CXX, else c++)."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def cpu_serves_bf16(cpu_kernels: bool = True) -> bool:
    """Whether a bf16 model is at least as fast as fp32 here: native bf16 arithmetic, or AVX2
    and FMA with pdserve's compiled operators on (`cpu_kernels`) and buildable."""
    if cpu_computes_bf16():
        return True
    return cpu_kernels and cpu_has_avx2_fma() and compiler_present()
