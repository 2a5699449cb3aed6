"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small model on a GPU is launch-bound: eagerly, each of a few hundred
kernels per step is launched from Python one by one. A CUDA graph replays the whole captured
forward with one launch. A graph replays fixed shapes at fixed addresses, so every captured
forward reads only this object's static buffers, and attention is the paged Triton kernel
(`model/triton_paged.py`), which reads each sequence's length and block table on the device
rather than shaping the step around them.

Life cycle:
- Built by the engine after its KV pool, where graphs apply (`applies`): CUDA, Triton, a dense
  model (MoE sizes its expert batches on the host; MLA has its own attention), one rank. Every
  bucket is captured at construction, largest first, all sharing one memory pool.
- Every decode-only step of B <= the largest bucket's sequences (`fits`) replays the smallest
  bucket >= B. Rows B.. of the bucket are padding: token 0 at position 0, writing its K/V into
  the pad block (a block of the pool the block manager never hands out) and attending to that
  block alone; their outputs are dropped.
- Lives as long as the engine and its KV pool. Any other step (a prompt in it, more sequences
  than the largest bucket, a per-layer hook) runs eagerly.

`capture` turns a forward over the static buffers into (replay, its output tensor): a CUDA
graph on a GPU (`cuda_capture`). Tests on a CPU pass one that runs the forward again at each
replay, which checks the buffers and the padding, not what capture itself forbids.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from pdserve.common.model_config import ModelConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model import triton_paged
from pdserve.engine.model.attention import AttentionMetadata, DecodeGroup
from pdserve.engine.request import Request
from pdserve.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

# (forward over the static buffers) -> (replay, the tensor each replay writes its output to)
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes captured: 1, 2, 4, then every multiple of 8 up to `max_batch`, and
    `max_batch` itself (vLLM's capture sizes follow the same pattern): a step pads at most 7
    rows, or doubles from 1 to 4."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = {b for b in (1, 2, 4) if b <= max_batch} | set(range(8, max_batch + 1, 8))
    return tuple(sorted(sizes | {max_batch}))


def bucket_for(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `batch` rows, or None when none does."""
    return next((b for b in buckets if b >= batch), None)


def applies(cfg: ModelConfig, device: str, tensor_parallel_size: int) -> bool:
    """Decode graphs can be captured for this engine (see the module's life cycle)."""
    return (triton_paged.available(device) and cfg.moe is None and cfg.mla is None
            and tensor_parallel_size == 1)


def cuda_capture(pool: tuple | None = None) -> Capture:
    """Captures on the current CUDA device, every graph in one memory pool (a bucket captured
    later reuses what the larger ones freed)."""
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    def capture(forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy inits and Triton's compile, uncaptured
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
        return graph.replay, out

    return capture


class DecodeGraphs:
    """`model`: the engine's decoder (called as `model(ids, positions, kv_cache, meta)`);
    `max_batch`: the scheduler's max_num_seqs; `max_model_len`: the longest context, which
    sizes the static block tables; `pad_block`: the block padding rows write to."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, max_batch: int,
                 max_model_len: int, pad_block: int, capture: Capture) -> None:
        if not 0 <= pad_block < kv_cache.num_blocks:
            raise ValueError(f"pad_block {pad_block} is not a block of the {kv_cache.num_blocks}"
                             f"-block pool")
        self.model, self.kv_cache, self.pad_block = model, kv_cache, pad_block
        self.block_size = kv_cache.block_size
        self.buckets = graph_buckets(max_batch)
        n, width = self.buckets[-1], -(-max_model_len // self.block_size)
        device = kv_cache.data.device
        # rows: input_ids, positions, slot_blocks, slot_offsets, lens; [n] long each
        self._rows = torch.zeros(5, n, dtype=torch.long, device=device)
        self._rows[2].fill_(pad_block)  # capture runs padding rows only
        self._rows[4].fill_(1)
        self._tables = torch.full((n, width), pad_block, dtype=torch.long, device=device)
        t0 = time.perf_counter()
        self._graphs = {b: capture(self._forward(b)) for b in reversed(self.buckets)}
        log.info("captured %d decode graphs (batch 1..%d) in %.1f s", len(self.buckets), n,
                 time.perf_counter() - t0)

    def fits(self, batch: SchedulerOutput) -> bool:
        """`batch` is decode only (one new token per sequence) and a bucket holds it."""
        return (len(batch.requests) <= self.buckets[-1]
                and all(n == 1 and not r.computing_prompt
                        for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)))

    def run(self, requests: list[Request]) -> torch.Tensor:
        """The final hidden states [B, hidden] of one decode step of `requests`, in order: a
        view of the bucket's output buffer, valid until the next `run`."""
        b = len(requests)
        bucket = bucket_for(b, self.buckets)
        if bucket is None or b == 0:
            raise ValueError(f"{b} sequences: the decode graphs hold 1 to {self.buckets[-1]}")
        rows, tables = self._host_inputs(requests, bucket)
        self._rows[:, :bucket].copy_(rows, non_blocking=True)
        self._tables[:bucket, : tables.shape[1]].copy_(tables, non_blocking=True)
        replay, out = self._graphs[bucket]
        replay()
        return out[:b]

    def _host_inputs(self, requests: list[Request], bucket: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [5, bucket] as `_rows`, tables [bucket, blocks of the longest context]; the
        padding rows' token 0 at position 0 in slot 0 of the pad block, attending to it alone."""
        bs, pad = self.block_size, self.pad_block
        rows = [[0] * bucket, [0] * bucket, [pad] * bucket, [0] * bucket, [1] * bucket]
        width = max(r.num_computed_tokens // bs + 1 for r in requests)
        tables = [[pad] * width for _ in range(bucket)]
        for i, r in enumerate(requests):
            pos = r.num_computed_tokens  # the new token's position
            used = pos // bs + 1
            for row, value in zip(rows, (r.token_ids[pos], pos, r.block_ids[pos // bs],
                                         pos % bs, pos + 1), strict=True):
                row[i] = value
            tables[i][:used] = r.block_ids[:used]
        return torch.tensor(rows), torch.tensor(tables)

    def _forward(self, b: int) -> Callable[[], torch.Tensor]:
        """The decode forward of the first `b` rows of the static buffers."""
        ids, positions, slot_blocks, slot_offsets, lens = self._rows[:, :b]
        meta = AttentionMetadata(
            slot_blocks=slot_blocks, slot_offsets=slot_offsets, prefills=[],
            decode_groups=[DecodeGroup(0, self._tables[:b].view(-1), lens, self.block_size)],
            kernels=triton_paged.KERNELS)
        return lambda: self.model(ids, positions, self.kv_cache, meta)
