"""How an engine runs its decode steps, chosen once at start:
- attention: pdserve's compiled operators on a CPU (chosen by the model, not here); the paged
  Triton kernels on a GPU where Triton is installed and they pass their check there; else
  PyTorch's SDPA over gathered blocks;
- CUDA graphs per batch bucket (`decode_graphs.py`) where they apply, unless the config says
  `enforce_eager`. Kernels that fail their check, or a capture that fails, leave the engine
  eager with a warning saying why, rather than failing its start.
"""

from __future__ import annotations

import logging

import torch

from pdserve.common.model_config import ModelConfig
from pdserve.config import EngineConfig
from pdserve.engine.decode_graphs import Capture, DecodeGraphs, applies, cuda_capture
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model import triton_paged
from pdserve.engine.model.attention import PagedKernels

log = logging.getLogger(__name__)


def paged_kernels(config: EngineConfig, dtype: torch.dtype,
                  capture: Capture | None) -> PagedKernels | None:
    """The Triton kernels where they run on the engine's device and are right there (or where
    a test's `capture` stand-in asks for graphs, which need them); else None (SDPA)."""
    if capture is not None:
        return triton_paged.KERNELS
    if not triton_paged.available(config.device):
        return None
    try:
        triton_paged.self_check(config.device, dtype)
    except Exception as e:  # a Triton or driver this kernel was not written for
        log.warning("the paged Triton attention failed its check on %s (%s); attention runs "
                    "on PyTorch's SDPA, without CUDA graphs", config.device, e)
        return None
    return triton_paged.KERNELS


def graph_capture(config: EngineConfig, model: ModelConfig, kv_cache: KVCache,
                  kernels: PagedKernels | None) -> Capture | None:
    """CUDA graph capture for this engine's decode steps, or None: not asked for
    (`enforce_eager`), not possible (`decode_graphs.applies`, the Triton kernels) or no block
    to spare for the padding rows."""
    if (config.enforce_eager or kernels is None or kv_cache.num_blocks < 2
            or not applies(model, config.device, config.tensor_parallel_size)):
        return None
    return cuda_capture()


def build_graphs(model: torch.nn.Module, kv_cache: KVCache, config: EngineConfig,
                 pad_block: int, capture: Capture) -> DecodeGraphs | None:
    """Every bucket captured, or None (with a warning) where a CUDA capture fails."""
    try:
        return DecodeGraphs(model, kv_cache, config.max_num_seqs, config.max_model_len,
                            pad_block, capture)
    except RuntimeError as e:
        if not kv_cache.data.is_cuda:
            raise
        log.warning("CUDA graph capture failed (%s); decode steps run eagerly", e)
        return None
