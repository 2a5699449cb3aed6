"""The names of engine options that the CLI, worker settings and cluster layouts validate before
any engine (and torch) is loaded: roles, dtype names and device strings."""

from __future__ import annotations

import logging
import re
from enum import StrEnum

from pdserve.common.cpu_features import cpu_serves_bf16

log = logging.getLogger(__name__)

# The engine's weight and KV dtypes; `pdserve.engine.engine.torch_dtype` maps one to torch's.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# What a user may ask for: a dtype, or "auto" (`resolve_dtype`)
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
DTYPE_HELP = ("weights and KV cache dtype; auto: bfloat16 on a GPU, on a CPU with bf16 "
              "arithmetic (AVX-512, AMX, AVX-NE-CONVERT, Arm BF16), and on an AVX2 CPU "
              "where pdserve's CPU operators build (bf16 weights, fp32 arithmetic); else "
              "float32, as PyTorch only emulates bf16 there (default: %(default)s)")
# Whole prompts (no chunking) share one engine step only while its prompt tokens stay within
# this; a longer prompt still runs, alone. Past a few hundred tokens a prefill is compute-bound,
# so packing long prompts saves almost nothing and holds every prompt's first token until the
# last one's is done (measured: four 1,750-token SmolLM2 prompts in one CPU step, 6.6 s, 0.94 ms
# a token; one alone, 1.4 s, 0.80). The simulator packs by the same rule.
PROMPT_PACK_TOKENS = 2048


def resolve_dtype(name: str, device: str, cpu_kernels: bool = True) -> str:
    """The dtype `name` stands for on `device`: itself, or for "auto" bfloat16 unless the
    device is a CPU that would run bf16 slower than fp32 (`cpu_features.cpu_serves_bf16`:
    `cpu_kernels` False, the engine on PyTorch operators alone, counts), then float32. Every
    worker of one machine resolves alike; workers on different machines can differ, and a
    decode worker refuses KV of another dtype with the reason."""
    if name not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    if name != "auto":
        return name
    if device.startswith("cpu") and not cpu_serves_bf16(cpu_kernels):
        log.info("dtype auto: float32 (this CPU has no bf16 arithmetic, and pdserve's AVX2 "
                 "kernel cannot run here)")
        return "float32"
    return "bfloat16"


def check_device(device: str) -> str:
    """`device` if it names one the engine takes: 'cpu', 'cuda' or 'cuda:N'; else ValueError."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return device


class Role(StrEnum):
    """What an engine does with a request.

    COLLOCATED runs prefill and decode. PREFILL stops each request after token 0 and keeps its
    blocks until `Engine.release()`; DECODE additionally accepts requests whose KV is written
    into reserved blocks from outside (`Engine.add_remote_request` / `Engine.kv_ready`).
    """

    COLLOCATED = "collocated"
    PREFILL = "prefill"
    DECODE = "decode"
