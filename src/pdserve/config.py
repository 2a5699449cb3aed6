"""Engine configuration: one frozen dataclass, validated at construction (torch-free: the engine
maps `dtype` to its torch dtype)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.engine_options import Role, check_device, resolve_dtype


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2"
    dtype: str = "auto"  # one of DTYPE_CHOICES; always a DTYPE_NAMES name once constructed
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
    # Processes computing each step, Megatron-style (`pdserve.engine.parallel`): attention
    # heads and MLP columns split across them, each holding its heads' share of the KV pool
    # (kv_cache_bytes each). Collocated serving only.
    tensor_parallel_size: int = 1
    # CUDA: decode steps run eagerly, kernel by kernel, instead of replaying CUDA graphs
    # captured per batch size at start (`engine/decode_graphs.py`). The CPU always runs
    # eagerly.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))
        check_device(self.device)
        object.__setattr__(self, "dtype",
                           resolve_dtype(self.dtype, self.device, self.cpu_kernels))
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
        if type(self.tensor_parallel_size) is not int or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got "
                             f"{self.tensor_parallel_size!r}")
        if (self.tensor_parallel_size > 1 and self.role != Role.COLLOCATED
                and not self.device.startswith("cpu")):
            raise ValueError(f"a {self.role.value} engine on {self.device} moves its KV to or "
                             f"from other engines, and the KV of a tensor-parallel engine on "
                             f"CUDA is a pool per device, which the transfer plane does not "
                             f"move: use role collocated, tensor_parallel_size 1, or the CPU "
                             f"(whose ranks share one pool)")

