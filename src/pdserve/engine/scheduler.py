"""Continuous batching under a token budget, with chunked prefill and preemption.

Each step every scheduled request computes tokens [num_computed, num_computed + n) of its
`token_ids`: a whole prompt (prefill), a chunk of it (chunked prefill), every token again after
a preemption (recompute), or the one newest token (decode). A request whose computed count
reaches its length samples a new token. Running requests go first, oldest first, so decodes
are never starved by new prompts; waiting requests are admitted in arrival order while the
budget, the sequence cap and the free blocks allow. Without chunking, whole prompts share a step
only while their prompt tokens stay within PROMPT_PACK_TOKENS (a longer one runs alone).

A prefill chunk (`prefill_chunk`, set by the worker from its measured rates and TPOT target:
`workers/prefill_budget.py`) caps the prompt tokens of a step while any request decodes: prompts
then go in chunks of at most that many tokens (chunking on, whatever the config says), so that
the streams' steps stay short; with no request decoding the step budget alone applies.

Memory: a request is admitted only with blocks for all its current tokens, and a decode step
needs at most one new block. When none is free the newest running request is preempted: its
blocks are freed and it waits to be recomputed. Requests in WAITING_FOR_KV are never
preempted: blocks that an outside writer may be filling stay theirs until they are verified or
the writer is known to be gone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.common.engine_options import PROMPT_PACK_TOKENS
from pdserve.config import EngineConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestState


@dataclass
class SchedulerOutput:
    """One step's work: `num_new_tokens[i]` tokens of `requests[i]` to compute."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of prompts being computed (a chunk, or a whole prompt); the rest decode."""
        return sum(n for r, n in zip(self.requests, self.num_new_tokens, strict=True)
                   if r.computing_prompt)

    def add(self, req: Request, n: int) -> None:
        self.requests.append(req)
        self.num_new_tokens.append(n)


class ChunkSite(NamedTuple):
    """The streams a step decodes beside its prompt tokens, and the tokens computed before them."""

    streams: int
    context: int


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: list[Request] = []  # decode role: reserved or queued for blocks
        self.num_preemptions = 0  # since start, for metrics and tests
        self.prefill_chunk: int | None = None  # most prompt tokens per step beside decodes

    def add(self, req: Request) -> None:
        if req.remote_prefill:
            req.state = RequestState.WAITING_FOR_KV
            self.waiting_for_kv.append(req)
        else:
            self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget, prefill = self._schedule_running(out, budget, self._prefill_budget(budget))
        if not out.preempted:
            self._schedule_waiting(out, budget, prefill)
        self.reserve_remote()
        return out

    def remove(self, req: Request) -> None:
        """Take a request out of whichever queue holds it (its blocks are the caller's)."""
        for queue in (self.running, self.waiting_for_kv):
            if req in queue:
                queue.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)

    def kv_ready(self, req: Request) -> None:
        """A reserved remote request's KV is complete and verified: it joins the decode batch."""
        self.waiting_for_kv.remove(req)
        req.state = RequestState.RUNNING
        self.running.append(req)

    def chunk_site(self) -> ChunkSite:
        """Where the next step's first prompt tokens would go: beside the requests decoding now,
        after a running prompt's (the oldest) computed tokens, else after the waiting head's
        cached prefix (0 with neither). What the worker prices that step's chunk at
        (`workers/prefill_budget.py`)."""
        streams = sum(1 for r in self.running if not r.computing_prompt)
        for req in self.running:
            if req.computing_prompt:
                return ChunkSite(streams, req.num_computed_tokens)
        if self.waiting:
            cached = len(self.bm.match_prefix(self.waiting[0].token_ids)) * self.bm.block_size
            return ChunkSite(streams, cached)
        return ChunkSite(streams, 0)

    def prompt_queue(self) -> tuple[tuple[float, int], ...]:
        """Each prompt still to give its first token, oldest first (the running prompts, then
        the waiting ones), as (its arrival time, monotonic seconds; the tokens left to compute
        up to and including its own, cached prefixes counted as work: an upper bound). A
        preempted request is recomputed in its turn but has had its first token: its work
        counts, its wait does not. What the worker's TTFT check reads (`misses_ttft`)."""
        out, left = [], 0
        prompts = [r for r in self.running if r.computing_prompt]
        for req in [*prompts, *self.waiting]:
            left += req.num_tokens - req.num_computed_tokens
            if not req.num_output_tokens:
                out.append((req.arrival_time, left))
        return tuple(out)

    # -- internals ----------------------------------------------------------------------------

    def _prefill_budget(self, budget: int) -> int:
        """The step's prompt tokens: the prefill chunk while a request decodes, else the
        budget."""
        if self.prefill_chunk is not None and any(
                r.num_tokens - r.num_computed_tokens == 1 for r in self.running):
            return min(budget, self.prefill_chunk)
        return budget

    def _schedule_running(self, out: SchedulerOutput, budget: int, prefill: int
                          ) -> tuple[int, int]:
        """Running requests, oldest first: decodes, and prompts within `prefill` tokens (one
        past it waits this step). The budgets left."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            left = req.num_tokens - req.num_computed_tokens
            n = min(left, budget) if left == 1 else min(left, budget, prefill)
            if n <= 0:
                i += 1
                continue
            while not self.bm.can_append(req):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self.bm.append(req)
                out.add(req, n)
                budget -= n
                prefill -= n if left > 1 else 0
                i += 1
                continue
            break  # `req` itself was preempted: nothing after it runs either
        return budget, prefill

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, prefill: int) -> None:
        """Waiting prompts, FIFO, within the budgets left: chunked (or capped), cut to fit;
        else whole, and a prompt joins others in the step only while their prompt tokens stay
        within PROMPT_PACK_TOKENS."""
        chunked = self.config.enable_chunked_prefill or prefill < budget  # a cap chunks too
        while self.waiting and min(budget, prefill) > 0 and \
                len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            limit = min(budget, prefill)
            cached = len(self.bm.match_prefix(req.token_ids)) * self.bm.block_size
            remaining = req.num_tokens - cached
            if not chunked and out.num_prefill_tokens and \
                    out.num_prefill_tokens + remaining > PROMPT_PACK_TOKENS:
                break
            if (remaining > limit and not chunked) or not self.bm.can_allocate(req):
                break
            self.bm.allocate(req)
            self.waiting.popleft()
            req.state = RequestState.RUNNING
            self.running.append(req)
            n = min(req.num_tokens - req.num_computed_tokens, limit)
            out.add(req, n)
            budget, prefill = budget - n, prefill - n

    def reserve_remote(self) -> None:
        for req in self.waiting_for_kv:
            if req.block_ids:
                continue
            if not self.bm.can_allocate(req, use_prefix_cache=False):
                break  # first come, first served: later ones wait behind it
            self.bm.allocate(req, use_prefix_cache=False)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.bm.free(req)
        req.num_computed_tokens = 0
        req.state = RequestState.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
