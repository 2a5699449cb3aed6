"""Discrete-event simulation of serving one trace on a cluster laid out one of three ways
(cluster.py: the layouts and limits). The event loop here drives the workers (pools.py,
paced_decode.py); routing.py chooses their requests, admission_gate.py admits them when the
router's back-pressure is modelled.

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
from typing import Any

from pdserve.planner.simulate.admission_gate import AdmissionGate
from pdserve.planner.simulate.calibration import StepCosts
from pdserve.planner.simulate.cluster import Cluster, Layout, check_fits
from pdserve.planner.simulate.metrics import ItlSamples, RequestRecord
from pdserve.planner.simulate.paced_decode import PacedDecodeWorker
from pdserve.planner.simulate.pools import (
    CollocatedWorker,
    DecodeBatch,
    DecodeWorker,
    PrefillWorker,
    Worker,
)
from pdserve.planner.simulate.prefix_cache import PrefixCache, PrefixTable
from pdserve.planner.simulate.routing import HEALTH_INTERVAL_S, Routing
from pdserve.planner.simulate.speed_timeline import SpeedTimeline, TimedCosts
from pdserve.planner.simulate.split_model import SplitRule
from pdserve.planner.simulate.trace import TraceRequest

_STEP_END, _KV_READY, _POLL, _EXPIRE, _ARRIVAL = 0, 1, 2, 3, 4


@dataclass
class SimResult:
    """Ended records (trace order; finished, or refused by admission), ITL samples and each
    pool's busy fraction."""

    layout: Layout
    records: list[RequestRecord]
    itl: ItlSamples
    busy: dict[str, float] = field(default_factory=dict)

    @property
    def local_prefills(self) -> int:
        """How many requests a split layout prefilled on their decode worker (the router's
        local path)."""
        return sum(1 for r in self.records if r.local)


class _Loop:
    """One run: workers, the event heap, the routing and (with `Cluster.admission`) the gate.

    Invariants: `events` holds (time, kind, sequence, payload), popped in that order; `now` is
    the time of the event being processed; `to_wake` holds the workers to kick once every
    event at `now` is processed (insertion order); `unsent` the closed loop's requests not sent
    yet, in trace order."""

    def __init__(self, layout: Layout, cluster: Cluster, costs: StepCosts,
                 trace_tokens: bool, table: PrefixTable | None = None,
                 speed: SpeedTimeline | None = None) -> None:
        # the trace's time 0 on the loop's clock: set once the warm-up has ended
        self.trace_start = math.inf
        if speed is not None:
            costs = TimedCosts(costs, speed, lambda: self.now - self.trace_start)
        self.layout, self.cluster, self.costs = layout, cluster, costs
        self.trace_tokens = trace_tokens
        self.table = table or PrefixTable.empty()
        self.unsent: deque[RequestRecord] = deque()
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
        self.routing = Routing(c, costs, self.table, self.prefill, self.decode, self.colloc,
                               self.wake)
        self.now = 0.0
        self.polled_at: float | None = None  # the last health check's time
        self.gate = AdmissionGate(c.admission, c, layout, self.routing, self) \
            if c.admission is not None else None

    def _cache(self) -> PrefixCache:
        """A worker's prefix cache, bounded by its KV capacity."""
        return PrefixCache(self.table, self.cluster.kv_capacity_tokens)

    def _decode_worker(self, index: int, trace_tokens: bool) -> DecodeWorker:
        """A decode worker; one that also prefills unless every prompt is split."""
        c, batch = self.cluster, DecodeBatch(self.itl, trace_tokens)
        if c.split is SplitRule.REMOTE:
            return DecodeWorker(index, self.costs, c.kv_capacity_tokens, c.max_batch, batch)
        return PacedDecodeWorker(index, self.costs, c.kv_capacity_tokens, c.max_batch, batch,
                                 c.prefill_budget_tokens, c.tpot_target_s, self._cache(),
                                 c.itl_target_s, c.ttft_target_s)

    def push(self, time: float, kind: int, payload: Any) -> None:
        heapq.heappush(self.events, (time, kind, next(self.seq), payload))

    def expire_at(self, time: float, pool: str, record: RequestRecord) -> None:
        self.push(time, _EXPIRE, (pool, record))

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

    def arrive(self, record: RequestRecord, now: float) -> None:
        """Route an arriving request (routing.py), or hand it to the admission gate."""
        routing = self.routing
        if self.gate is not None:
            self.gate.arrive(record, now)
        elif self.layout is not Layout.DISAGG:
            routing.to_colloc(record, routing.pick("colloc", record))
        elif self.cluster.split is SplitRule.REMOTE:
            routing.to_prefill(record, routing.pick("prefill", record))
        else:
            j = routing.pick("decode", record)
            if (prefill := routing.route(record, j)) is not None:
                routing.split(record, j, prefill)

    def release(self, pool: str, record: RequestRecord, now: float, tokens: int) -> None:
        """`record` completed its part in `pool` holding `tokens` of KV (no-op without
        admission)."""
        if self.gate is not None:
            self.gate.release(pool, record, now, tokens)

    def step_end(self, worker: Worker, now: float) -> None:
        worker.busy = False
        prefilled, finished = worker.finish_step(now)
        if isinstance(worker, PrefillWorker):
            for record in prefilled:
                j = self.routing.prefill_ended(record, worker.index)
                self.release("prefill", record, now, record.prompt_tokens)
                if record.output_tokens > 1:
                    self.send_to_decode(record, now, j)
                elif j is not None:
                    self.routing.close("decode", j)  # token 0 ended it: its decode leg closes
        else:
            self.routing.close(worker.role, worker.index, len(finished))
        for record in finished:
            self.release("decode", record, now, record.prompt_tokens + record.output_tokens)
            self.client_free(now)
        self.wake(worker)

    def send_to_decode(self, record: RequestRecord, now: float, j: int | None) -> None:
        """The KV of a prefilled request travels to decode worker j (None: the policy's pick
        now, counted from now)."""
        if j is None:
            j = self.routing.decode_for(record)
        self.push(now + self.cluster.transfer_seconds(record.prompt_tokens), _KV_READY,
                  (record, j))

    def kv_ready(self, record: RequestRecord, j: int, now: float) -> None:
        self.decode[j].queue.append(record)
        self.wake(self.decode[j])

    def client_free(self, now: float) -> None:
        """Closed loop: a request ended, so its client, seeing that half a front-end round trip
        later, sends the next one waiting, which reaches a worker the other half later."""
        if self.unsent:
            half = self.cluster.frontend_latency_s / 2
            record = self.unsent.popleft()
            record.arrival_s = now + half
            self.push(now + 2 * half, _ARRIVAL, record)

    def run(self, records: list[RequestRecord], clients: int | None = None) -> float:
        """Process every event; returns the time of the last one but the health checks.
        `clients`: closed loop, the first that many requests arrive at their times and each
        later one when a request ends (trace order); None: every request at its time."""
        first = records if clients is None else records[:clients]
        self.unsent = deque(records[len(first):])
        for record in first:
            self.push(record.arrival_s + self.cluster.frontend_latency_s / 2, _ARRIVAL, record)
        self.push(self._next_poll(), _POLL, None)
        end = self.now
        while self.events:
            now, kind, _, payload = heapq.heappop(self.events)
            self.now = now
            end = end if kind == _POLL else now
            if kind == _STEP_END:
                self.step_end(payload, now)
            elif kind == _KV_READY:
                self.kv_ready(payload[0], payload[1], now)
            elif kind == _POLL:
                self.poll(now)
            elif kind == _EXPIRE:  # pushed by the gate only
                self.gate.expire(payload[0], payload[1], now)
            else:
                self.arrive(payload, now)
            if self.gate is not None:
                self.gate.ask_prefill_slots(now)
            if not self.events or self.events[0][0] > now:
                for worker in self.to_wake:
                    self.kick(worker, now)
                self.to_wake.clear()
        return end

    def poll(self, now: float) -> None:
        """The router's health check (routing.py `poll`), then the next one, while anything
        else is still to happen."""
        self.routing.poll()
        self.polled_at = now
        if self.events:
            self.push(now + HEALTH_INTERVAL_S, _POLL, None)

    def _next_poll(self) -> float:
        """The first health check from now on, every HEALTH_INTERVAL_S since the first (at 0):
        a run after the warm-up keeps its phase."""
        if self.polled_at is None:
            return self.now
        return self.polled_at + math.ceil((self.now - self.polled_at) / HEALTH_INTERVAL_S) \
            * HEALTH_INTERVAL_S

    def warm_up(self, requests: Sequence[TraceRequest], first_index: int) -> float:
        """Serve `requests` one after the other before the trace, as bench compare warms a
        cluster up; returns when the last one ended. What the workers and the router learnt
        (the rates the workers reported, the health checks' phase) carries into the run; the
        warm-up's ITLs and busy time do not. Their records take indices from `first_index`
        (past the trace's: they share no prefix with it)."""
        if not requests:
            return 0.0
        records = [RequestRecord(first_index + i, 0.0, r.prompt_tokens, r.output_tokens,
                                 token_times=[] if self.trace_tokens else None)
                   for i, r in enumerate(requests)]
        end = self.run(records, clients=1)
        self.itl.values.clear()
        self.itl.counts.clear()
        for worker in (*self.prefill, *self.decode, *self.colloc):
            worker.busy_s = 0.0
        return end

    def leftovers(self) -> list[str]:
        """What a finished run still holds: nothing, unless the model lost track of work."""
        left = self.routing.leftovers()
        left += [f"{w.role} worker {w.index}: {w.kv.used} KV tokens"
                 for w in (*self.decode, *self.colloc) if w.kv.used]
        return left + (self.gate.leftovers() if self.gate is not None else [])

    def busy_fractions(self, span: float) -> dict[str, float]:
        pools = {"prefill": self.prefill, "decode": self.decode, "colloc": self.colloc}
        return {role: sum(w.busy_s for w in workers) / (len(workers) * span)
                for role, workers in pools.items() if workers and span > 0}


def _shift(records: Sequence[RequestRecord], seconds: float, arrivals: bool) -> None:
    """Move the records' token times (and with `arrivals`, their arrival and refusal times
    too) by `seconds`."""
    if not seconds:
        return
    for r in records:
        if arrivals:
            r.arrival_s += seconds
            if r.refused_s is not None:
                r.refused_s += seconds
        if r.first_token_s is not None:
            r.first_token_s += seconds
        if r.finish_s is not None:
            r.finish_s += seconds
        if r.token_times is not None:
            r.token_times[:] = [t + seconds for t in r.token_times]


def simulate(layout: Layout | str, cluster: Cluster, costs: StepCosts,
             trace: Sequence[TraceRequest], trace_tokens: bool = False,
             clients: int | None = None, warm_up: Sequence[TraceRequest] = (),
             speed: SpeedTimeline | None = None) -> SimResult:
    """Run `trace` on `cluster` in `layout`; `trace_tokens` keeps every token's time;
    `clients`: replay it in closed loop with that many clients (`_Loop.run`); `warm_up`:
    requests served one after the other first (`_Loop.warm_up`; the records' times count from
    the trace's start all the same); `speed`: every step priced at a measured run's speed at
    its start (speed_timeline.py), else at `costs` alone."""
    layout = Layout(layout)
    check_fits([*trace, *warm_up], cluster)
    records = [RequestRecord(i, r.arrival_s, r.prompt_tokens, r.output_tokens,
                             token_times=[] if trace_tokens else None)
               for i, r in enumerate(trace)]
    loop = _Loop(layout, cluster, costs, trace_tokens, PrefixTable(trace, cluster.block_tokens),
                 speed)
    start = loop.trace_start = loop.warm_up(warm_up, len(records))
    _shift(records, start, arrivals=True)
    end = loop.run(records, clients)
    if left := loop.leftovers():
        raise RuntimeError(f"the simulation ended holding work: {'; '.join(left)}")
    span = end - min(r.arrival_s for r in records)
    _shift(records, -start, arrivals=True)
    # token times as the client sees them: half a front-end round trip after their step
    _shift(records, cluster.frontend_latency_s / 2, arrivals=False)
    return SimResult(layout, records, loop.itl, loop.busy_fractions(span))
