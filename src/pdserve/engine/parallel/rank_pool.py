"""How big an engine's KV pool is, and which pool each tensor-parallel rank computes with.

- One process: one pool of `kv_cache_bytes` (or `num_kv_blocks` blocks).
- Ranks on the CPU: one pool of the same size with every KV head, shared by the ranks
  (`shared_pool.py`); each rank's views narrow to its own heads. A block id means the same
  token slots for every rank, and rank 0's block manager serves them all.
- Ranks each on its own CUDA device: a pool per rank holding its heads only, `kv_cache_bytes`
  each, every rank with the block count of the rank holding the most KV heads. The transfer
  plane cannot move these (a handshake names one pool), so such engines run collocated only
  (`EngineConfig` refuses the prefill and decode roles).
"""

from __future__ import annotations

import math

import torch

from pdserve.common.model_config import ModelConfig
from pdserve.config import EngineConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.parallel.shard_plan import ShardPlan, largest_share
from pdserve.engine.parallel.shared_pool import SharedPool


def shares_pool(config: EngineConfig) -> bool:
    """Whether the ranks of a tensor-parallel engine with this config share one pool."""
    return torch.device(config.device).type == "cpu"


def kv_pool(config: EngineConfig, model: ModelConfig) -> tuple[int, SharedPool | None]:
    """(blocks per pool, the pool the ranks share, or None: one process, or a pool per rank)."""
    tp = config.tensor_parallel_size
    if tp > 1 and not shares_pool(config):
        return num_blocks(config, largest_share(model, tp)), None
    n = num_blocks(config, model)
    if tp == 1:
        return n, None
    shape = KVCache.shape(model, n, config.block_size)
    return n, SharedPool(math.prod(shape) * getattr(torch, config.dtype).itemsize)


def rank_kv_cache(config: EngineConfig, model: ModelConfig, blocks: int,
                  pool: SharedPool | None, plan: ShardPlan | None) -> KVCache:
    """The pool rank `plan.rank` computes with (the only rank when `plan` is None)."""
    dtype = getattr(torch, config.dtype)
    if plan is None:
        return KVCache(model, blocks, config.block_size, dtype, config.device)
    if pool is None:
        return KVCache(plan.local_config(model), blocks, config.block_size, dtype,
                       config.device)
    data = pool.tensor(KVCache.shape(model, blocks, config.block_size), dtype)
    return KVCache(model, blocks, config.block_size, dtype, config.device, pool=data,
                   heads=plan.kv_heads)


def num_blocks(config: EngineConfig, model: ModelConfig) -> int:
    if config.num_kv_blocks is not None:
        n = config.num_kv_blocks
    else:
        n = config.kv_cache_bytes // KVCache.bytes_per_block(model, config.block_size,
                                                             getattr(torch, config.dtype))
    need = -(-config.max_model_len // config.block_size)
    if n < need:
        raise ValueError(f"the KV pool has {n} blocks but one sequence of max_model_len "
                         f"({config.max_model_len}) needs {need}; give more KV memory or "
                         f"lower max_model_len")
    return n
