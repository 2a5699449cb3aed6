"""The simulator's workers: what one prefill, decode or collocated worker runs in each step.

A worker is driven by the event loop (events.py): `start_step(now)` picks the step's work and
returns its seconds (None: nothing to do, the worker idles), `finish_step(now)` applies it and
returns (requests whose prompt finished prefill, requests that finished).

Scheduling rules (ours, after vLLM's scheduler; documented assumptions of the model):
- KV admission: a request reserves prompt + output tokens of its worker's KV when admitted and
  frees them when it finishes, so nothing is ever preempted; the queue is FIFO and waits while
  its head does not fit or the batch holds `max_batch` requests.
- prefill worker: takes queued prompts FIFO into one step while their tokens fit the step budget
  (the first always goes, however long); token 0 of each is sampled at the step's end. Its
  memory is not modelled (a prompt's KV leaves when the step ends).
- decode worker: continuous batching; every step gives each running request one token. A request
  producing token k (k >= 1) attends over prompt + k tokens.
- collocated worker, as pdserve's engine schedules (engine/scheduler.py): every step runs all
  running decodes first, then prompt tokens (one mixed step: a prompt's tokens and the
  streams' next tokens come out together). Without chunking prompts are admitted whole, the
  first of a step always and the next ones while the step's prompt tokens stay within
  `budget_tokens` (pdserve's PROMPT_PACK_TOKENS); with chunked prefill the step's budget is
  `chunk` (pdserve's max_num_batched_tokens, decode tokens included): partially prefilled
  prompts first (FIFO), then newly admitted ones, cut to what the decodes leave.
- prefix cache (prefix_cache.py), on every worker that prefills: a prompt admitted where its
  shared prefix is cached starts at the reused tokens R (`prefilled` = R), so its steps compute
  and count only the rest (the step budgets and packing count uncached tokens, as the engine's
  scheduler does) while its chunks still attend over the prefix; a prompt's prefix enters its
  worker's cache once computed there.
"""

from __future__ import annotations

import heapq
from collections import deque

from pdserve.planner.simulate.calibration import Chunk, StepCosts
from pdserve.planner.simulate.metrics import ItlSamples, RequestRecord
from pdserve.planner.simulate.prefix_cache import PrefixCache
from pdserve.planner.simulate.step_window import StepWindow


def first_token(record: RequestRecord, now: float) -> None:
    """Token 0 is out: at the end of the step that computed the prompt's last token."""
    record.first_token_s = now
    if record.token_times is not None:
        record.token_times.append(now)


def start_decoding(prefilled: list[RequestRecord], now: float, kv: KvPool, batch: DecodeBatch
                   ) -> list[RequestRecord]:
    """Prompts whose prefill ended at `now` on a worker that decodes them: token 0 is out;
    those asking for one token finish (their KV freed), the others join `batch`. Returns the
    finished ones."""
    finished = []
    for record in prefilled:
        first_token(record, now)
        if record.output_tokens == 1:
            record.finish_s = now
            kv.release(record)
            finished.append(record)
        else:
            batch.join(record)
    return finished


class KvPool:
    """KV slots of one worker, in tokens: 0 <= used <= capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    def fits(self, record: RequestRecord) -> bool:
        return self.used + record.prompt_tokens + record.output_tokens <= self.capacity

    def take(self, record: RequestRecord) -> None:
        self.used += record.prompt_tokens + record.output_tokens

    def release(self, record: RequestRecord) -> None:
        self.used -= record.prompt_tokens + record.output_tokens


class DecodeBatch:
    """Running decodes of one worker, stepped together.

    Invariants: `context_sum` is the summed context of the next step (prompt + k for a request
    about to produce token k); a request joining after `steps` steps finishes at the end of step
    steps + output_tokens - 1. ITLs: requests that were in the previous step add one run of
    (now - previous step end); requests new to the batch add now - their token 0 time.
    """

    def __init__(self, itl: ItlSamples, trace_tokens: bool = False) -> None:
        self.itl = itl
        self.trace_tokens = trace_tokens
        self.running: dict[int, RequestRecord] = {}
        self.finish_at: list[tuple[int, int]] = []  # heap of (step number, request index)
        self.fresh: list[RequestRecord] = []
        self.steps = 0
        self.context_sum = 0
        self.last_step_end = 0.0

    @property
    def size(self) -> int:
        return len(self.running)

    def join(self, record: RequestRecord) -> None:
        self.running[record.index] = record
        heapq.heappush(self.finish_at, (self.steps + record.output_tokens - 1, record.index))
        self.context_sum += record.prompt_tokens + 1
        self.fresh.append(record)

    def complete_step(self, now: float) -> list[RequestRecord]:
        """One token for every running request; returns (and removes) those now finished."""
        continuing = len(self.running) - len(self.fresh)
        if continuing:
            self.itl.add(now - self.last_step_end, continuing)
        for record in self.fresh:
            self.itl.add(now - record.first_token_s)  # type: ignore[operator]
        self.fresh.clear()
        if self.trace_tokens:
            for record in self.running.values():
                record.token_times.append(now)  # type: ignore[union-attr]
        self.steps += 1
        self.context_sum += len(self.running)
        self.last_step_end = now
        finished = []
        while self.finish_at and self.finish_at[0][0] == self.steps:
            record = self.running.pop(heapq.heappop(self.finish_at)[1])
            record.finish_s = now
            self.context_sum -= record.prompt_tokens + record.output_tokens
            finished.append(record)
        return finished


class Worker:
    """What the event loop sees of every worker: role, index, busy flag, busy seconds."""

    role = ""

    def __init__(self, index: int, costs: StepCosts) -> None:
        self.index = index
        self.costs = costs
        self.busy = False
        self.busy_s = 0.0

    def start_step(self, now: float) -> float | None:
        raise NotImplementedError

    def finish_step(self, now: float) -> tuple[list[RequestRecord], list[RequestRecord]]:
        raise NotImplementedError


def uncached(record: RequestRecord, prefixes: PrefixCache) -> int:
    """The prompt tokens `record` would compute if admitted now on the worker of `prefixes`."""
    return record.prompt_tokens - prefixes.peek(record)


class PrefillWorker(Worker):
    """Disaggregated prefill: whole prompts, their uncached tokens under a budget per step."""

    role = "prefill"

    def __init__(self, index: int, costs: StepCosts, budget_tokens: int,
                 prefixes: PrefixCache | None = None) -> None:
        super().__init__(index, costs)
        self.budget = budget_tokens
        self.prefixes = prefixes or PrefixCache.disabled()
        self.queue: deque[RequestRecord] = deque()
        self.step: list[RequestRecord] = []
        self.steps = StepWindow()  # what it reports of its speed (the router's R_p)
        self.step_tokens, self.step_s = 0, 0.0

    def start_step(self, now: float) -> float | None:
        if not self.queue:
            return None
        tokens = 0
        while self.queue and (not self.step
                              or tokens + uncached(self.queue[0], self.prefixes) <= self.budget):
            record = self.queue.popleft()
            record.prefilled = self.prefixes.take(record)
            tokens += record.prompt_tokens - record.prefilled
            self.step.append(record)
        chunks = [Chunk(r.prefilled, r.prompt_tokens - r.prefilled, True) for r in self.step]
        self.step_tokens = tokens
        self.step_s = self.costs.step_seconds(chunks, 0, 0)
        return self.step_s

    def finish_step(self, now: float) -> tuple[list[RequestRecord], list[RequestRecord]]:
        self.steps.record(self.step_tokens, 0, self.step_s)
        done, self.step = self.step, []
        finished = []
        for record in done:
            record.prefilled = record.prompt_tokens
            self.prefixes.computed(record)
            first_token(record, now)
            if record.output_tokens == 1:
                record.finish_s = now
                finished.append(record)
        return done, finished


class DecodeWorker(Worker):
    """Disaggregated decode: continuous batching with KV admission."""

    role = "decode"

    def __init__(self, index: int, costs: StepCosts, kv_capacity: int, max_batch: int,
                 batch: DecodeBatch) -> None:
        super().__init__(index, costs)
        self.kv = KvPool(kv_capacity)
        self.max_batch = max_batch
        self.queue: deque[RequestRecord] = deque()
        self.batch = batch

    def start_step(self, now: float) -> float | None:
        queue, batch = self.queue, self.batch
        while queue and batch.size < self.max_batch and self.kv.fits(queue[0]):
            self.kv.take(queue[0])
            batch.join(queue.popleft())
        if not batch.size:
            return None
        return self.costs.step_seconds((), batch.size, batch.context_sum)

    def finish_step(self, now: float) -> tuple[list[RequestRecord], list[RequestRecord]]:
        finished = self.batch.complete_step(now)
        for record in finished:
            self.kv.release(record)
        return [], finished


class CollocatedWorker(Worker):
    """Prefill and decode on one worker, in mixed steps; `chunk` None: whole prompts, else
    chunked prefill (module docstring)."""

    role = "colloc"

    def __init__(self, index: int, costs: StepCosts, kv_capacity: int, max_batch: int,
                 budget_tokens: int, chunk: int | None, batch: DecodeBatch,
                 prefixes: PrefixCache | None = None) -> None:
        super().__init__(index, costs)
        self.kv = KvPool(kv_capacity)
        self.prefixes = prefixes or PrefixCache.disabled()
        self.max_batch, self.budget, self.chunk = max_batch, budget_tokens, chunk
        self.waiting: deque[RequestRecord] = deque()
        self.prefilling: deque[RequestRecord] = deque()  # admitted, prompt not done
        self.batch = batch
        self.step_chunks: list[tuple[RequestRecord, int]] = []
        self.step_decodes = 0

    def _admit(self) -> RequestRecord | None:
        """The head of the queue, admitted (KV reserved), or None if it cannot be yet."""
        if not self.waiting or self.batch.size + len(self.prefilling) >= self.max_batch:
            return None
        if not self.kv.fits(self.waiting[0]):
            return None
        record = self.waiting.popleft()
        self.kv.take(record)
        record.prefilled = self.prefixes.take(record)
        self.prefilling.append(record)
        return record

    def _plan_whole(self) -> list[tuple[RequestRecord, int]]:
        plan: list[tuple[RequestRecord, int]] = []
        tokens = 0
        while self.waiting and (not plan or tokens + uncached(self.waiting[0], self.prefixes)
                                <= self.budget):
            record = self._admit()
            if record is None:
                break
            plan.append((record, record.prompt_tokens - record.prefilled))
            tokens += record.prompt_tokens - record.prefilled
        return plan

    def _plan_chunked(self, chunk: int) -> list[tuple[RequestRecord, int]]:
        plan: list[tuple[RequestRecord, int]] = []
        for record in self.prefilling:
            if chunk == 0:
                break
            take = min(chunk, record.prompt_tokens - record.prefilled)
            plan.append((record, take))
            chunk -= take
        while chunk > 0 and (record := self._admit()) is not None:
            take = min(chunk, record.prompt_tokens - record.prefilled)
            plan.append((record, take))
            chunk -= take
        return plan

    def start_step(self, now: float) -> float | None:
        if not self.waiting and not self.prefilling:  # the common case: decodes alone
            self.step_chunks, self.step_decodes = [], self.batch.size
            if not self.step_decodes:
                return None
            return self.costs.step_seconds((), self.step_decodes, self.batch.context_sum)
        self.step_decodes = self.batch.size
        if self.chunk is None:
            self.step_chunks = self._plan_whole()
        else:
            self.step_chunks = self._plan_chunked(max(0, self.chunk - self.step_decodes))
        if not self.step_chunks and not self.step_decodes:
            return None
        chunks = [Chunk(r.prefilled, n, r.prefilled + n == r.prompt_tokens)
                  for r, n in self.step_chunks]
        context = self.batch.context_sum if self.step_decodes else 0
        return self.costs.step_seconds(chunks, self.step_decodes, context)

    def finish_step(self, now: float) -> tuple[list[RequestRecord], list[RequestRecord]]:
        finished = self.batch.complete_step(now) if self.step_decodes else []
        for record in finished:
            self.kv.release(record)
        prefilled = []
        for record, tokens in self.step_chunks:
            record.prefilled += tokens
            self.prefixes.computed(record)
            if record.prefilled == record.prompt_tokens:
                prefilled.append(self.prefilling.popleft())  # done prompts lead the queue
        self.step_chunks = []
        finished += start_decoding(prefilled, now, self.kv, self.batch)
        return prefilled, finished
