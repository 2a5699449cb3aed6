"""Turns a scheduled batch into model inputs, runs the model, returns the rows to sample.

Rows are laid out prefills first (each request's new tokens contiguous), then one row per
decoding request, so attention can batch every decode at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.decode_graphs import DecodeGraphs
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    PagedKernels,
    PrefillSeq,
)
from pdserve.engine.model.llama import LlamaForCausalLM
from pdserve.engine.parallel.rank_group import RankGroup
from pdserve.engine.request import Request
from pdserve.engine.scheduler import SchedulerOutput

# on_layer(i, batch): layer i's K and V of every token in `batch` are in the KV pool.
LayerHook = Callable[[int, SchedulerOutput], None]
# Decode contexts up to this many tokens never start a group of their own (their padding is
# cheap next to one more attention call per layer).
GROUP_MIN_TOKENS = 256


def _new_group(first: Request, req: Request) -> bool:
    """`req` (a longer context) starts a new decode group after the one `first` opened."""
    ctx = req.num_computed_tokens + 1
    return ctx > GROUP_MIN_TOKENS and ctx > 2 * (first.num_computed_tokens + 1)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]  # row of each sampling request's last token
    sampling: list[Request]  # requests that sample a token this step, aligned with sample_rows


class ModelRunner:
    """`ranks`: the other ranks of a tensor-parallel engine, sent every step's inputs before
    this rank's forward. `kernels`: paged attention off the CPU operators (the Triton
    kernels on a GPU), None for SDPA. `graphs`: decode steps that fit them replay a
    captured graph instead of running the model eagerly."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: str,
                 ranks: RankGroup | None = None, kernels: PagedKernels | None = None,
                 graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.ranks = ranks
        self.kernels = kernels
        self.graphs = graphs
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size

    def run(self, batch: SchedulerOutput, on_layer: LayerHook | None = None
            ) -> tuple[torch.Tensor, list[Request]]:
        """Compute the batch; return logits [N, vocab] for the N requests that sample.
        `on_layer(i, batch)` runs when layer i's KV of the batch is in the pool (on CUDA after
        a stream sync, which costs the overlap of CPU launch and GPU compute)."""
        if self.graphs is not None and on_layer is None and self.graphs.fits(batch):
            # decode only: every request samples, in the batch's order
            return (self.model.compute_logits(self.graphs.run(batch.requests)),
                    list(batch.requests))
        inputs = self.prepare(batch)
        after = None
        if on_layer is not None:
            def after(i: int) -> None:
                if self.kv_cache.data.is_cuda:
                    torch.cuda.current_stream().synchronize()
                on_layer(i, batch)
        with (contextlib.nullcontext() if self.ranks is None else
              self.ranks.step(inputs.input_ids, inputs.positions, inputs.meta)):
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta,
                                after)
        if not inputs.sampling:
            return hidden.new_empty(0, self.model.cfg.vocab_size), []
        rows = torch.tensor(inputs.sample_rows, device=hidden.device)
        return self.model.compute_logits(hidden[rows]), inputs.sampling

    def prepare(self, batch: SchedulerOutput) -> ModelInputs:
        pairs = list(zip(batch.requests, batch.num_new_tokens, strict=True))
        # a prompt's tokens always go through prefill attention, even one alone (the last of a
        # chunked prompt, or all a prefix-cache hit left), so that a prompt position's result
        # is the same however the prompt was cut
        prefills = [(r, n) for r, n in pairs if n > 1 or r.computing_prompt]
        # shortest context first, so that decode_groups are runs of consecutive rows
        decodes = sorted(((r, n) for r, n in pairs if n == 1 and not r.computing_prompt),
                         key=lambda p: p[0].num_computed_tokens)
        ids: list[int] = []
        pos: list[int] = []
        seqs: list[PrefillSeq] = []
        sample_rows: list[int] = []
        sampling: list[Request] = []
        for i, (req, n) in enumerate(prefills + decodes):
            start = req.num_computed_tokens
            if i < len(prefills):
                seqs.append(PrefillSeq(len(ids), n, start + n, self._long(req.block_ids)))
            ids.extend(req.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            if start + n == req.num_tokens:
                sample_rows.append(len(ids) - 1)
                sampling.append(req)
        positions = self._long(pos)
        meta = AttentionMetadata(
            slot_blocks=self._slot_blocks(prefills + decodes, positions),
            slot_offsets=positions % self.block_size,
            prefills=seqs,
            decode_groups=self._decode_groups([r for r, _ in decodes], len(ids) - len(decodes)),
            kernels=self.kernels,
        )
        return ModelInputs(self._long(ids), positions, meta, sample_rows, sampling)

    def _slot_blocks(self, pairs: list[tuple[Request, int]], positions: torch.Tensor):
        blocks: list[int] = []
        for req, n in pairs:
            start = req.num_computed_tokens
            first, last = start // self.block_size, (start + n - 1) // self.block_size
            for b in range(first, last + 1):
                lo = max(start, b * self.block_size)
                hi = min(start + n, (b + 1) * self.block_size)
                blocks.extend([req.block_ids[b]] * (hi - lo))
        return self._long(blocks)

    def _decode_groups(self, reqs: list[Request], first_row: int) -> list[DecodeGroup]:
        """Decode requests (sorted by context) in groups attended at once: a group grows until
        a request's context is over twice the group's first one and over GROUP_MIN_TOKENS, so
        padding at most doubles the attention of long contexts, short ones share one group,
        and a batch with contexts up to L has at most log2(L / GROUP_MIN_TOKENS) + 1 groups."""
        groups: list[DecodeGroup] = []
        start = 0
        for i in range(1, len(reqs) + 1):
            if i == len(reqs) or _new_group(reqs[start], reqs[i]):
                groups.append(self._decode_tables(reqs[start:i], first_row + start))
                start = i
        return groups

    def _decode_tables(self, reqs: list[Request], first_row: int) -> DecodeGroup:
        """Flat padded block tables [B * W] and each request's context length [B]."""
        lens = [r.num_computed_tokens + 1 for r in reqs]  # context includes the new token
        width = max(-(-n // self.block_size) for n in lens)
        flat: list[int] = []
        for r in reqs:
            row = r.block_ids[:width]
            flat += row + [0] * (width - len(row))
        return DecodeGroup(first_row, self._long(flat), self._long(lens), self.block_size)

    def _long(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
