"""Discrete-event simulation of serving one trace on a cluster laid out one of three ways.

Layouts:
- disagg: `prefill_workers` prefill workers and `decode_workers` decode workers. A request's
  token 0 comes at the end of its prefill step (TTFT does not wait for the KV transfer); its
  KV then travels for transfer_seconds(KV bytes per GPU of the prompt, link_gbps) (kv_math,
  each rank ships its own shard at once) and it joins its decode worker's admission queue.
- colloc: `collocated_workers` workers doing both, prefill first (decodes stall for prefills).
- chunked: the same workers with chunked prefill of at most `chunk_tokens` prompt tokens per step.
Worker rules are in pools.py, step costs in calibration.py.

Routing (ours): with `Cluster.split` remote (the default), an arriving prompt goes to the
prefill worker with the fewest queued and running prompt tokens, and once prefilled to the
decode worker with the fewest assigned requests (queued, in transfer or running). With split
local or measured, as the router does: the decode worker with the fewest open requests is
chosen at arrival, and the prompt is prefilled there (in chunks paced to
`Cluster.tpot_target_s` beside its streams, paced_decode.py) or on a prefill worker, whose KV
then travels to it (split_model.py has the rule). A collocated request goes to the worker with
the fewest assigned requests; ties go to the lowest index.

Prefix cache (prefix_cache.py): every worker that prefills keeps the shared prefixes whose KV
it holds and computes only the rest of a prompt that starts with one. The router's view is
modelled apart (what it routed where, as its prefix index): it counts each prompt's uncached
tokens on a worker from it, in the prefill queues (Q_p, Q_d) and in the measured split rule
(U_d on the decode worker, U_p on each prefill worker; the link priced with the whole prompt's
KV, as the router prices it). A split prompt's KV transfer moves the whole prompt: the
engine's decode side reserves blocks for every prompt token, without its prefix cache, and
receives them all. With `Cluster.policy` prefix
(the router's `--policy prefix`, `PrefixAware`), every worker choice above is instead the
lowest legs - (prompt blocks the router routed there) / PREFIX_BLOCKS_PER_LEG, legs being the
requests assigned to the worker (for a prefill worker, its queued and running prompts); ties
to the lowest index. The measured rule's prefill worker stays the one of its t_remote.

Admission (admission.py, with `Cluster.admission`; None, the default: none): a request takes
a slot in the decode pool (decode or collocated workers) at arrival, on the worker the routing
rule above picks among those with room, and, if it is split, then one in the prefill pool (the
rule's prefill worker if it has room, else the least loaded with room); over the caps it waits
in the pool's FIFO queue, or is refused (429 queue full, 503 waited too long). With admission a
remote-split request's decode worker is chosen at arrival, as the router does. A refused
request ends there: no token, and its closed-loop client sends its next request.

The loop pops events in (time, kind, sequence) order: step ends, then KV arrivals, then the end
of queue waits, then request arrivals at equal times; idle workers start their next step only
after every event of that time, so requests arriving together share a step. Without admission
every request runs to completion: a queue only delays. The model is deterministic: the same
trace, cluster and costs give the same records.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pdserve.planner.kv_math import check_link, kv_bytes, transfer_seconds
from pdserve.planner.plan import DEFAULT_MAX_DECODE_BATCH, PREFILL_BATCH_TOKENS
from pdserve.planner.simulate.admission import Admission, AdmissionPool
from pdserve.planner.simulate.calibration import StepCosts
from pdserve.planner.simulate.metrics import ItlSamples, RequestRecord
from pdserve.planner.simulate.paced_decode import PacedDecodeWorker
from pdserve.planner.simulate.pools import (
    CollocatedWorker,
    DecodeBatch,
    DecodeWorker,
    PrefillWorker,
    Worker,
)
from pdserve.planner.simulate.prefix_cache import PrefixCache, PrefixTable, RoutedPrefixes
from pdserve.planner.simulate.split_model import (
    BLOCK_TOKENS,
    DEFAULT_TPOT_TARGET_S,
    Route,
    SplitRule,
    prefill_rate,
    route,
)
from pdserve.planner.simulate.trace import TraceRequest

DEFAULT_CHUNK_TOKENS = 2048  # our default prefill tokens per chunked step
PREFIX_BLOCKS_PER_LEG = 8  # router/policies.py PrefixAware: a cached block is worth 1/8 leg

_STEP_END, _KV_READY, _EXPIRE, _ARRIVAL = 0, 1, 2, 3


class Layout(StrEnum):
    DISAGG = "disagg"
    COLLOC = "colloc"
    CHUNKED = "chunked"


class RoutePolicy(StrEnum):
    """The router's worker choice (its `--policy`; round_robin is not modelled)."""

    LEAST_LOADED = "least_loaded"
    PREFIX = "prefix"


def _check_count(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{field} must be a positive integer, got {value!r}")


def _split_rule(value: object) -> SplitRule:
    try:
        return SplitRule(value)
    except (TypeError, ValueError):
        raise ValueError(f"split must be one of {', '.join(SplitRule)}, got {value!r}") from None


def _route_policy(value: object) -> RoutePolicy:
    try:
        return RoutePolicy(value)
    except (TypeError, ValueError):
        raise ValueError(f"policy must be one of {', '.join(RoutePolicy)}, got {value!r}") \
            from None


def _check_target(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not 0 < value < math.inf:
        raise ValueError(f"tpot_target_s (--slo-tpot-ms) must be a positive number of seconds, "
                         f"got {value!r}")


@dataclass(frozen=True)
class Cluster:
    """Worker counts and per-worker limits; KV sizes in tokens and bytes per GPU; how a split
    layout routes its prompts (`split`, split_model.py) and the TPOT target its decode workers
    pace local prefills to (the router's `--slo-tpot-ms`); the KV block (`block_tokens`, the
    engine's `block_size`, default 16: a prefix cache reuses whole blocks only) and how the
    router picks workers (`policy`: the module docstring); the router's back-pressure
    (`admission`, admission.py; None: none, every request is served)."""

    kv_capacity_tokens: int  # KV one worker holds (per GPU of its TP group, in tokens)
    kv_bytes_per_token_rank: int  # KV bytes per token per GPU (what one rank ships)
    link_gbps: float
    prefill_workers: int = 1
    decode_workers: int = 1
    collocated_workers: int = 2
    max_batch: int = DEFAULT_MAX_DECODE_BATCH
    prefill_budget_tokens: int = PREFILL_BATCH_TOKENS
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    split: SplitRule = SplitRule.REMOTE
    tpot_target_s: float = DEFAULT_TPOT_TARGET_S
    block_tokens: int = BLOCK_TOKENS
    policy: RoutePolicy = RoutePolicy.LEAST_LOADED
    admission: Admission | None = None

    def __post_init__(self) -> None:
        for name, flag in (("kv_capacity_tokens", "--kv-capacity-tokens"),
                           ("kv_bytes_per_token_rank", "model KV"),
                           ("prefill_workers", "--prefill"), ("decode_workers", "--decode"),
                           ("collocated_workers", "--collocated"), ("max_batch", "--max-batch"),
                           ("prefill_budget_tokens", "--prefill-budget"),
                           ("chunk_tokens", "--chunk"), ("block_tokens", "block size")):
            _check_count(f"{name} ({flag})", getattr(self, name))
        check_link(self.link_gbps)
        object.__setattr__(self, "split", _split_rule(self.split))
        object.__setattr__(self, "policy", _route_policy(self.policy))
        _check_target(self.tpot_target_s)
        if self.admission is not None and not isinstance(self.admission, Admission):
            raise ValueError(f"admission must be an Admission or None, got {self.admission!r}")

    def transfer_seconds(self, prompt_tokens: int) -> float:
        return transfer_seconds(kv_bytes(self.kv_bytes_per_token_rank, prompt_tokens),
                                self.link_gbps)


@dataclass
class SimResult:
    """Ended records (trace order; finished, or refused by admission), ITL samples, each
    pool's busy fraction and how many requests a split layout prefilled on their decode worker
    (the router's local path)."""

    layout: Layout
    records: list[RequestRecord]
    itl: ItlSamples
    busy: dict[str, float] = field(default_factory=dict)
    local_prefills: int = 0


def check_fits(trace: Sequence[TraceRequest], cluster: Cluster) -> None:
    """ValueError when the trace is empty or a request's KV can never fit a worker."""
    if not trace:
        raise ValueError("the trace holds no requests")
    worst = max(range(len(trace)), key=lambda i: trace[i].prompt_tokens + trace[i].output_tokens)
    need = trace[worst].prompt_tokens + trace[worst].output_tokens
    if need > cluster.kv_capacity_tokens:
        raise ValueError(f"request {worst} needs {need:,} tokens of KV (prompt + output) but a "
                         f"worker holds {cluster.kv_capacity_tokens:,}: raise --tp or shorten "
                         "the requests")


class _Loop:
    """One run: workers, their routing loads, the event heap.

    Invariants: loads["prefill"][i] is the uncached prompt tokens (as the router counted them,
    `queued`) routed to prefill worker i and not yet prefilled (Q_p); loads["decode"][j] the
    requests open on decode worker j (split ones from their arrival unless `split` is remote,
    from their prefill's end then); `bound` maps a split request routed at arrival to its
    decode worker until its prefill ends; `routed[role][i]` is what the router sent to worker
    i of `role` (prefix_cache.RoutedPrefixes). With admission, `pools` holds the decode pool
    (and the prefill pool when disaggregated); a request's decode slot is held from its grant
    until it ends (its load counted as long), its prefill slot until its prefill ends;
    `splitting` maps a split request that holds its decode slot on worker j but no prefill slot
    yet to (j, the rule's prefill worker), and `pending` lists those still to ask for one
    (asked after the event being processed, at its time)."""

    def __init__(self, layout: Layout, cluster: Cluster, costs: StepCosts,
                 trace_tokens: bool, table: PrefixTable | None = None) -> None:
        self.layout, self.cluster, self.costs = layout, cluster, costs
        self.table = table or PrefixTable.empty()
        self.bound: dict[int, int] = {}
        self.queued: dict[int, int] = {}  # request index -> its tokens in loads["prefill"]
        self.unsent: deque[RequestRecord] = deque()  # closed loop: requests not sent yet
        self.local_prefills = 0
        self.itl = ItlSamples()
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = itertools.count()
        self.to_wake: dict[Worker, None] = {}  # insertion-ordered set
        c = cluster
        if layout is Layout.DISAGG:
            self.prefill = [PrefillWorker(i, costs, c.prefill_budget_tokens, self._cache())
                            for i in range(c.prefill_workers)]
            self.decode = [self._decode_worker(i, trace_tokens)
                           for i in range(c.decode_workers)]
            self.colloc: list[CollocatedWorker] = []
        else:
            chunk = c.chunk_tokens if layout is Layout.CHUNKED else None
            self.prefill, self.decode = [], []
            self.colloc = [CollocatedWorker(i, costs, c.kv_capacity_tokens, c.max_batch,
                                            c.prefill_budget_tokens, chunk,
                                            DecodeBatch(self.itl, trace_tokens), self._cache())
                           for i in range(c.collocated_workers)]
        self.paced = [w for w in self.decode if isinstance(w, PacedDecodeWorker)]
        self.loads = {"prefill": [0] * len(self.prefill), "decode": [0] * len(self.decode),
                      "colloc": [0] * len(self.colloc)}
        self.routed = {role: [RoutedPrefixes(self.table, c.block_tokens) for _ in loads]
                       for role, loads in self.loads.items()}
        self.now = 0.0
        self.splitting: dict[int, tuple[int, int | None]] = {}
        self.pending: deque[RequestRecord] = deque()
        self.pools = self._pools(c.admission) if c.admission is not None else {}
        self.wait_s = c.admission.max_queue_wait_s if c.admission is not None else math.inf

    def _pools(self, admission: Admission) -> dict[str, AdmissionPool]:
        """The router's admission pools: decode (decode or collocated workers), prefill."""
        c = self.cluster
        kv = c.kv_capacity_tokens // c.block_tokens * c.block_tokens  # whole blocks
        decode = self.decode or self.colloc
        pools = {"decode": AdmissionPool("decode", len(decode), admission, c.max_batch, kv,
                                         self._choose_decode, self._decode_granted,
                                         self._refuse)}
        if self.prefill:
            pools["prefill"] = AdmissionPool("prefill", len(self.prefill), admission,
                                             c.max_batch, kv, self._choose_prefill,
                                             self._prefill_granted, self._refuse)
        return pools

    def _cache(self) -> PrefixCache:
        """A worker's prefix cache, bounded by its KV capacity."""
        return PrefixCache(self.table, self.cluster.kv_capacity_tokens)

    def _decode_worker(self, index: int, trace_tokens: bool) -> DecodeWorker:
        """A decode worker; one that also prefills unless every prompt is split."""
        c, batch = self.cluster, DecodeBatch(self.itl, trace_tokens)
        if c.split is SplitRule.REMOTE:
            return DecodeWorker(index, self.costs, c.kv_capacity_tokens, c.max_batch, batch)
        return PacedDecodeWorker(index, self.costs, c.kv_capacity_tokens, c.max_batch, batch,
                                 c.prefill_budget_tokens, c.tpot_target_s, self._cache())

    def push(self, time: float, kind: int, payload: Any) -> None:
        heapq.heappush(self.events, (time, kind, next(self.seq), payload))

    def wake(self, worker: Worker) -> None:
        """Ask `worker` to start a step once every event at the current time is processed."""
        self.to_wake[worker] = None

    def kick(self, worker: Worker, now: float) -> None:
        """Start the worker's next step if it is idle and has work."""
        if worker.busy:
            return
        seconds = worker.start_step(now)
        if seconds is not None:
            worker.busy = True
            worker.busy_s += seconds
            self.push(now + seconds, _STEP_END, worker)

    def _pick(self, role: str, record: RequestRecord, among: Sequence[int] | None = None
              ) -> int:
        """The worker of `role` for `record` under `Cluster.policy` (module docstring), among
        the workers `among` (ascending indices; None: all)."""
        loads = self.loads[role]
        among = range(len(loads)) if among is None else among
        if self.cluster.policy is RoutePolicy.LEAST_LOADED:
            return min(among, key=loads.__getitem__)
        legs = [len(w.queue) + len(w.step) for w in self.prefill] if role == "prefill" \
            else loads
        routed = self.routed[role]
        return min(among, key=lambda i: (
            legs[i] - routed[i].blocks(record) / PREFIX_BLOCKS_PER_LEG, i))

    def arrive(self, record: RequestRecord, now: float) -> None:
        if self.pools:
            self.acquire("decode", record, now, self.wait_s)
        elif self.layout is not Layout.DISAGG:
            self.to_colloc(record, self._pick("colloc", record))
        elif self.cluster.split is SplitRule.REMOTE:
            self.to_prefill(record, self._pick("prefill", record))
        else:
            self.route(record, self._pick("decode", record))

    def to_colloc(self, record: RequestRecord, i: int) -> None:
        self.loads["colloc"][i] += 1
        self.routed["colloc"][i].add(record)
        self.colloc[i].waiting.append(record)
        self.wake(self.colloc[i])

    # -- admission (admission.py) ------------------------------------------------------------

    def acquire(self, pool: str, record: RequestRecord, now: float, wait_s: float) -> None:
        """Ask `pool` for a slot for `record`; a queued one's wait ends in an _EXPIRE event."""
        expires = self.pools[pool].acquire(record, now, wait_s)
        if expires is not None and expires < math.inf:
            self.push(expires, _EXPIRE, (pool, record))

    def _choose_decode(self, record: RequestRecord, free: list[int]) -> int:
        return self._pick("decode" if self.decode else "colloc", record, free)

    def _decode_granted(self, record: RequestRecord, j: int) -> None:
        """The request holds a slot on decode (or collocated) worker j: route it there."""
        if self.layout is not Layout.DISAGG:
            self.to_colloc(record, j)
        elif self.cluster.split is SplitRule.REMOTE:
            self.loads["decode"][j] += 1
            self.routed["decode"][j].add(record)
            self.split_to(record, j, None)
        else:
            self.route(record, j)

    def split_to(self, record: RequestRecord, j: int, prefill: int | None) -> None:
        """`record`, bound to decode worker j, is prefilled on prefill worker `prefill` (None:
        the least loaded), once it holds a prefill slot when admission is modelled."""
        if not self.pools:
            self.bound[record.index] = j
            self.to_prefill(record, prefill)
            return
        self.splitting[record.index] = (j, prefill)
        self.pending.append(record)

    def ask_prefill_slots(self, now: float) -> None:
        """Split requests holding a decode slot ask for a prefill slot, within what is left
        of their wait since arrival."""
        while self.pending:
            record = self.pending.popleft()
            self.acquire("prefill", record, now, record.arrival_s + self.wait_s - now)

    def _choose_prefill(self, record: RequestRecord, free: list[int]) -> int:
        chosen = self.splitting[record.index][1]
        return chosen if chosen in free else self._pick("prefill", record, free)

    def _prefill_granted(self, record: RequestRecord, i: int) -> None:
        j, _ = self.splitting.pop(record.index)
        self.bound[record.index] = j
        self.to_prefill(record, i)

    def _refuse(self, record: RequestRecord, status: int) -> None:
        """Admission refused `record` (429 or 503): it ends now without a token; a decode slot
        it holds is given back, and its closed-loop client sends the next request."""
        record.refused, record.refused_s = status, self.now
        if (split := self.splitting.pop(record.index, None)) is not None:
            self.loads["decode"][split[0]] -= 1
        self.pools["decode"].release(record, self.now, None)
        self.client_free(self.now)

    def release(self, pool: str, record: RequestRecord, now: float, tokens: int) -> None:
        """`record` completed its part in `pool` holding `tokens` of KV (no-op without
        admission)."""
        if self.pools:
            self.pools[pool].release(record, now, tokens)

    # -- routing -------------------------------------------------------------------------------

    def to_prefill(self, record: RequestRecord, i: int | None) -> None:
        """Queue `record` on prefill worker i (None: the policy's pick), counted in Q_p as the
        router counts it."""
        if i is None:
            i = self._pick("prefill", record)
        tokens = self.routed["prefill"][i].uncached(record)
        self.routed["prefill"][i].add(record)
        self.queued[record.index] = tokens
        self.loads["prefill"][i] += tokens
        self.prefill[i].queue.append(record)
        self.wake(self.prefill[i])

    def route(self, record: RequestRecord, j: int) -> None:
        """The router's path (split_model.py) on decode worker j: where to prefill; U is the
        prompt's uncached tokens on that decode worker, as the router counts them."""
        self.loads["decode"][j] += 1
        tokens = self.routed["decode"][j].uncached(record)
        path = self._decide(record, j, tokens)
        self.routed["decode"][j].add(record)
        if path is None or path.local:
            self.local_prefills += 1
            self.paced[j].add_local(record, tokens)
            self.wake(self.paced[j])
        else:
            self.split_to(record, j, path.prefill_index)

    def _decide(self, record: RequestRecord, j: int, tokens: int) -> Route | None:
        """The measured rule's decision for `record`, `tokens` of it uncached on decode worker
        j (each prefill worker counted with what it lacks, the link with the whole prompt's
        KV); None: split local."""
        if self.cluster.split is SplitRule.LOCAL:
            return None
        worker = self.paced[j]
        remote = [routed.uncached(record) for routed in self.routed["prefill"]]
        return route(tokens, worker.backlog_tokens, worker.local_rate(tokens),
                     self.loads["prefill"], remote, lambda u: prefill_rate(self.costs, u),
                     self.cluster.transfer_seconds(record.prompt_tokens))

    def step_end(self, worker: Worker, now: float) -> None:
        worker.busy = False
        prefilled, finished = worker.finish_step(now)
        if isinstance(worker, PrefillWorker):
            for record in prefilled:
                self.loads["prefill"][worker.index] -= self.queued.pop(record.index)
                self.release("prefill", record, now, record.prompt_tokens)
                j = self.bound.pop(record.index, None)
                if record.output_tokens > 1:
                    self.send_to_decode(record, now, j)
                elif j is not None:
                    self.loads["decode"][j] -= 1  # token 0 ended it: its decode leg closes
        else:
            self.loads[worker.role][worker.index] -= len(finished)
        for record in finished:
            self.release("decode", record, now, record.prompt_tokens + record.output_tokens)
            self.client_free(now)
        self.wake(worker)

    def send_to_decode(self, record: RequestRecord, now: float, j: int | None) -> None:
        """The KV of a prefilled request travels to decode worker j (None: the least loaded
        now, counted from now)."""
        if j is None:
            j = self._pick("decode", record)
            self.loads["decode"][j] += 1
            self.routed["decode"][j].add(record)
        self.push(now + self.cluster.transfer_seconds(record.prompt_tokens), _KV_READY,
                  (record, j))

    def kv_ready(self, record: RequestRecord, j: int, now: float) -> None:
        self.decode[j].queue.append(record)
        self.wake(self.decode[j])

    def client_free(self, now: float) -> None:
        """Closed loop: a request ended, so its client sends the next one waiting, now."""
        if self.unsent:
            record = self.unsent.popleft()
            record.arrival_s = now
            self.push(now, _ARRIVAL, record)

    def run(self, records: list[RequestRecord], clients: int | None = None) -> float:
        """Process every event; returns the time of the last one. `clients`: closed loop, the
        first that many requests arrive at their times and each later one when a request
        ends (trace order); None: every request at its time."""
        first = records if clients is None else records[:clients]
        self.unsent = deque(records[len(first):])
        for record in first:
            self.push(record.arrival_s, _ARRIVAL, record)
        now = 0.0
        while self.events:
            now, kind, _, payload = heapq.heappop(self.events)
            self.now = now
            if kind == _STEP_END:
                self.step_end(payload, now)
            elif kind == _KV_READY:
                self.kv_ready(payload[0], payload[1], now)
            elif kind == _EXPIRE:
                self.pools[payload[0]].expire(payload[1], now)
            else:
                self.arrive(payload, now)
            self.ask_prefill_slots(now)
            if not self.events or self.events[0][0] > now:
                for worker in self.to_wake:
                    self.kick(worker, now)
                self.to_wake.clear()
        return now

    def leftovers(self) -> list[str]:
        """What a finished run still holds: nothing, unless the model lost track of work."""
        left = [f"{role} worker {i}: load {n}" for role, loads in self.loads.items()
                for i, n in enumerate(loads) if n]
        left += [f"{w.role} worker {w.index}: {w.kv.used} KV tokens"
                 for w in (*self.decode, *self.colloc) if w.kv.used]
        left += [f"request {i} queued for prefill" for i in self.queued]
        left += [f"request {i} waits for a prefill slot" for i in self.splitting]
        left += [line for pool in self.pools.values() for line in pool.leftovers()]
        return left + [f"request {i} bound to decode worker {j}" for i, j in self.bound.items()]

    def busy_fractions(self, span: float) -> dict[str, float]:
        pools = {"prefill": self.prefill, "decode": self.decode, "colloc": self.colloc}
        return {role: sum(w.busy_s for w in workers) / (len(workers) * span)
                for role, workers in pools.items() if workers and span > 0}


def simulate(layout: Layout | str, cluster: Cluster, costs: StepCosts,
             trace: Sequence[TraceRequest], trace_tokens: bool = False,
             clients: int | None = None) -> SimResult:
    """Run `trace` on `cluster` in `layout`; `trace_tokens` keeps every token's time;
    `clients`: replay it in closed loop with that many clients (`_Loop.run`)."""
    layout = Layout(layout)
    check_fits(trace, cluster)
    records = [RequestRecord(i, r.arrival_s, r.prompt_tokens, r.output_tokens,
                             token_times=[] if trace_tokens else None)
               for i, r in enumerate(trace)]
    loop = _Loop(layout, cluster, costs, trace_tokens, PrefixTable(trace, cluster.block_tokens))
    end = loop.run(records, clients)
    if left := loop.leftovers():
        raise RuntimeError(f"the simulation ended holding work: {'; '.join(left)}")
    span = end - min(r.arrival_s for r in records)
    return SimResult(layout, records, loop.itl, loop.busy_fractions(span), loop.local_prefills)
