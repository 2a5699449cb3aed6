"""Engine configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


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


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2"
    dtype: str = "bfloat16"
    device: str = "cpu"
    role: Role = Role.COLLOCATED
    block_size: int = 16
    # KV pool size: an explicit block count wins; otherwise kv_cache_bytes is divided up.
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 512 * 2**20
    max_num_seqs: int = 64
    # Tokens computed per step. None: 512 with chunked prefill, else the whole context
    # (so any prompt fits in one step).
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's own context length
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = True
    seed: int = 0
    # bf16 on CPU: pdserve's compiled operators (fused norms, rotary, activation, decode
    # attention; `pdserve.engine.kernels`). False runs PyTorch operators only.
    cpu_kernels: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        check_device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
