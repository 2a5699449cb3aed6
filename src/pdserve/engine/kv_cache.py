"""The paged KV pool of one engine.

Layout: one tensor [num_blocks, num_layers, 2 (K, V), block_size, kv_heads, head_dim]. A block
id addresses the same token slots in every layer, and one block is one contiguous region
holding every layer's K and V: moving a request's KV is one region per block, the fewest
descriptors a transfer can have (NIXL moves few large regions much faster than many small
ones). A (block, layer) slice is still contiguous for layer-wise streaming.
Attention reads a layer through a strided view, gathering blocks by id.

A model with Multi-head Latent Attention (`ModelConfig.mla`, DeepSeek-V2/V3) keeps a latent
pool instead: [num_blocks, num_layers, 1, block_size, 1, kv_lora_rank + qk_rope_head_dim], one
row per token per layer (the normalised latent c_KV, then the rotated key shared by every
head). The same axes, with the K/V axis and the head axis of size 1, so blocks and (block,
layer) slices stay contiguous and the transfer plane moves them unchanged.
"""

from __future__ import annotations

import torch

from pdserve.common.model_config import ModelConfig
from pdserve.engine import huge_pages


class KVCache:
    """`data` is the whole pool (what the transfer plane moves). `layers` are the views this
    process computes with: every KV head, or with `heads` only those (a tensor-parallel rank
    over a pool its ranks share, `parallel/shared_pool.py`), each slot's rows then strided
    over the other ranks' heads.

    `pool`: a zeroed tensor of `KVCache.shape(...)` to use instead of allocating one."""

    def __init__(
        self,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pool: torch.Tensor | None = None,
        heads: range | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = model.num_layers
        self.is_latent = model.mla is not None
        shape = self.shape(model, num_blocks, block_size)
        if pool is not None:
            if tuple(pool.shape) != shape or pool.dtype != dtype:
                raise ValueError(f"the pool given is {list(pool.shape)} {pool.dtype}; this model "
                                 f"needs {list(shape)} {dtype}")
            self.data = pool
        elif torch.device(device).type == "cpu":  # blocks are read at random: huge pages
            self.data = huge_pages.zeros(shape, dtype)
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        h = slice(None) if heads is None else slice(heads.start, heads.stop)
        # per layer: K and V views of [num_blocks, block_size, kv_heads (of `heads`), head_dim];
        # latent: a 1-tuple, the view [num_blocks, block_size, latent_dim]
        self.layers: list[tuple[torch.Tensor, ...]] = (
            [(self.data[:, i, 0, :, 0],) for i in range(self.num_layers)] if self.is_latent
            else [(self.data[:, i, 0, :, h], self.data[:, i, 1, :, h])
                  for i in range(self.num_layers)])

    @staticmethod
    def shape(model: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
        if model.mla is not None:  # [num_blocks, layers, 1, block_size, 1, latent_dim]
            return (num_blocks, model.num_layers, 1, block_size, 1, model.mla.latent_dim)
        # [num_blocks, layers, 2, block_size, kv_heads, head_dim]
        return (num_blocks, model.num_layers, 2, block_size, model.num_kv_heads, model.head_dim)

    @staticmethod
    def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return block_size * model.kv_bytes_per_token(torch.finfo(dtype).bits // 8)

    @property
    def block_nbytes(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    def block(self, block_id: int) -> torch.Tensor:
        """One block's KV for every layer: [layers, 2, block_size, kv_heads, head_dim]
        (latent: [layers, 1, block_size, 1, latent_dim])."""
        return self.data[block_id]

    def copy_blocks_from(self, src: KVCache, src_ids: list[int], dst_ids: list[int],
                         layers: slice = slice(None)) -> None:
        """In-process hand-over: block src_ids[i] of `src` into block dst_ids[i] of this pool
        (only the `layers` slices of each block when given)."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destinations")
        if src.data.shape[1:] != self.data.shape[1:] or src.data.dtype != self.data.dtype:
            raise ValueError("KV pools differ in layout or dtype; blocks cannot be copied")
        idx_src = torch.tensor(src_ids, dtype=torch.long, device=src.data.device)
        idx_dst = torch.tensor(dst_ids, dtype=torch.long, device=self.data.device)
        self.data[idx_dst, layers] = src.data[idx_src, layers].to(self.data.device)
