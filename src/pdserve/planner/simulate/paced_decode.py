"""A split layout's decode worker that also prefills the prompts the router keeps local, in
paced chunks beside its streams (split_model.py has the chunk rule; the engine's scheduler
and workers/prefill_budget.py are what it models).

Each step: KV-arrived split requests join the batch first (as `DecodeWorker`), then local
prompts are admitted FIFO (prompt + output tokens of KV reserved, the batch and prompts being
prefilled together at most `max_batch`) as the step's prompt tokens reach them. With streams
decoding, the step computes at most the paced chunk C of prompt tokens (FIFO over the prompts,
a started one first), C as the worker sets it from its own recent steps at the first prompt's
computed tokens (chunk_pacer.py); with none, whole prompts under the token budget (the first
always).
Token 0 of a prompt comes at the end of the step that computed its last token; the request
then joins this worker's batch (its KV is here: no transfer).

Prefix cache (prefix_cache.py): a local prompt whose shared prefix this worker holds starts at
the reused tokens (the lookup is at admission; the step's plan reads it for the prompts it
would admit); its prefix enters the cache once computed here, and so does the prefix of every
split request whose KV arrives (the engine hashes received blocks as its own).

Invariants: `backlog_tokens` is the summed uncached prompt tokens, as the router counted them
when it routed each (`add_local`), of local prompts before their token 0 (Q_d); `prefilling`
holds admitted prompts in admission order, only its head partly computed.
"""

from __future__ import annotations

from collections import deque

from pdserve.planner.simulate.calibration import Chunk, StepCosts
from pdserve.planner.simulate.chunk_pacer import ChunkPacer
from pdserve.planner.simulate.metrics import RequestRecord
from pdserve.planner.simulate.pools import DecodeBatch, DecodeWorker, start_decoding
from pdserve.planner.simulate.prefix_cache import PrefixCache
from pdserve.planner.simulate.split_model import BLOCK_TOKENS, Seen
from pdserve.planner.simulate.step_window import Rates

Planned = list[tuple[RequestRecord, int]]  # (prompt, its tokens computed this step)


class PacedDecodeWorker(DecodeWorker):
    """Decode with continuous batching plus local prefills paced to `tpot_target_s` (each step
    within `itl_target_s` where given, chunk_pacer.py)."""

    def __init__(self, index: int, costs: StepCosts, kv_capacity: int, max_batch: int,
                 batch: DecodeBatch, budget_tokens: int, tpot_target_s: float,
                 prefixes: PrefixCache | None = None, itl_target_s: float | None = None,
                 ttft_target_s: float | None = None) -> None:
        super().__init__(index, costs, kv_capacity, max_batch, batch)
        self.budget, self.tpot_target_s = budget_tokens, tpot_target_s
        self.prefixes = prefixes or PrefixCache.disabled()
        self.backlog_of: dict[int, int] = {}  # request index -> its tokens in backlog_tokens
        self.waiting: deque[RequestRecord] = deque()  # local prompts not admitted
        self.prefilling: deque[RequestRecord] = deque()  # admitted, prompt not done
        self.backlog_tokens = 0
        self.step_chunks: Planned = []
        self.step_decodes = 0
        self.step_s = 0.0
        self.pacer = ChunkPacer(tpot_target_s, BLOCK_TOKENS, itl_target_s, ttft_target_s)

    def add_local(self, record: RequestRecord, uncached: int | None = None) -> None:
        """A local prompt, counted in the backlog as `uncached` tokens (None: the whole
        prompt)."""
        tokens = record.prompt_tokens if uncached is None else uncached
        self.waiting.append(record)
        self.backlog_of[record.index] = tokens
        self.backlog_tokens += tokens

    def seen(self, legs: int, rates: Rates) -> Seen:
        """This worker as the router sees it, with `legs` open on it and `rates` the last it
        read of its reports (split_model.py)."""
        return Seen(rates, self.backlog_tokens, legs, self.pacer.chunk_of(rates))

    def start_step(self, now: float) -> float | None:
        self._admit_arrived()
        ready = self._ready()
        decodes = self.step_decodes = self.batch.size
        if not ready:
            self.step_chunks = []
            if not decodes:
                return None
            self.step_s = self.costs.step_seconds((), decodes, self.batch.context_sum)
            return self.step_s
        self.step_chunks = self._paced(ready, decodes, now) if decodes else self._whole(ready)
        for record, _ in self.step_chunks[len(self.prefilling):]:
            self._admit_local(record)
        self.step_s = self.costs.step_seconds(_chunks(self.step_chunks), decodes,
                                              self.batch.context_sum if decodes else 0)
        return self.step_s

    def finish_step(self, now: float) -> tuple[list[RequestRecord], list[RequestRecord]]:
        pairs = sum(n * r.prefilled + n * (n + 1) // 2 for r, n in self.step_chunks)
        self.pacer.record(sum(n for _, n in self.step_chunks), self.step_decodes, self.step_s,
                          pairs)
        finished = self.batch.complete_step(now) if self.step_decodes else []
        for record in finished:
            self.kv.release(record)
        prefilled = self._advance()
        finished += start_decoding(prefilled, now, self.kv, self.batch)
        return prefilled, finished

    def _admit_arrived(self) -> None:
        """KV-arrived split requests join the batch, FIFO, while batch and KV allow."""
        queue, batch = self.queue, self.batch
        while queue and batch.size + len(self.prefilling) < self.max_batch and \
                self.kv.fits(queue[0]):
            self.kv.take(queue[0])
            self.prefixes.received(queue[0])
            batch.join(queue.popleft())

    def _ready(self) -> list[RequestRecord]:
        """Prompts this step may compute: those admitted, then the waiting ones that would be
        admitted in turn (nothing is reserved here)."""
        ready = list(self.prefilling)
        room = self.max_batch - self.batch.size - len(ready)
        free = self.kv.capacity - self.kv.used
        for record in self.waiting:
            need = record.prompt_tokens + record.output_tokens
            if room <= 0 or need > free:
                break
            record.prefilled = self.prefixes.peek(record)  # what admission would reuse
            ready.append(record)
            room, free = room - 1, free - need
        return ready

    def _admit_local(self, record: RequestRecord) -> None:
        if self.waiting.popleft() is not record:
            raise RuntimeError("local prompts must be admitted in arrival order")
        self.kv.take(record)
        record.prefilled = self.prefixes.take(record)
        self.prefilling.append(record)

    def _paced(self, ready: list[RequestRecord], decodes: int, now: float) -> Planned:
        """The step's prompt tokens beside `decodes` streams: the budget, capped by the
        worker's chunk (none before it timed a decode-only step)."""
        most = min(self.budget, sum(r.prompt_tokens - r.prefilled for r in ready))
        cap = self.pacer.chunk(now, decodes, ready[0].prefilled, self._queue())
        return _take(ready, most if cap is None else min(most, cap))

    def _queue(self) -> list[tuple[float, int]]:
        """The prompts not yet computed here, oldest first: (arrival, the prompt tokens left
        up to and including its own), as `Scheduler.prompt_queue`."""
        out, left = [], 0
        for record in [*self.prefilling, *self.waiting]:
            left += record.prompt_tokens - record.prefilled
            out.append((record.arrival_s, left))
        return out

    def _whole(self, ready: list[RequestRecord]) -> Planned:
        plan: Planned = []
        tokens = 0
        for record in ready:
            left = record.prompt_tokens - record.prefilled
            if plan and tokens + left > self.budget:
                break
            plan.append((record, left))
            tokens += left
        return plan

    def _advance(self) -> list[RequestRecord]:
        """Apply the step's chunks; the prompts they completed (a prefix of `prefilling`)."""
        done = []
        for record, tokens in self.step_chunks:
            record.prefilled += tokens
            self.prefixes.computed(record)
            if record.prefilled == record.prompt_tokens:
                done.append(self.prefilling.popleft())
                self.backlog_tokens -= self.backlog_of.pop(record.index)
        self.step_chunks = []
        return done


def _take(ready: list[RequestRecord], tokens: int) -> Planned:
    """`tokens` prompt tokens over `ready`, FIFO, each prompt up to what it has left."""
    plan: Planned = []
    for record in ready:
        if tokens <= 0:
            break
        n = min(tokens, record.prompt_tokens - record.prefilled)
        plan.append((record, n))
        tokens -= n
    return plan


def _chunks(plan: Planned) -> list[Chunk]:
    return [Chunk(r.prefilled, n, r.prefilled + n == r.prompt_tokens) for r, n in plan]
