"""The simulator's routing (routing.py) and its admission gate (admission_gate.py) on their
own, without the event loop: who gets a request, what the router counts, and who is told."""

from __future__ import annotations

from pdserve.planner.simulate.admission import QUEUE_FULL, Admission
from pdserve.planner.simulate.admission_gate import AdmissionGate
from pdserve.planner.simulate.cluster import Layout, RoutePolicy
from pdserve.planner.simulate.metrics import ItlSamples, RequestRecord
from pdserve.planner.simulate.paced_decode import PacedDecodeWorker
from pdserve.planner.simulate.pools import CollocatedWorker, DecodeBatch, PrefillWorker, Worker
from pdserve.planner.simulate.prefix_cache import PrefixTable
from pdserve.planner.simulate.routing import Routing
from pdserve.planner.simulate.split_model import SplitRule
from pdserve.planner.simulate.step_window import WINDOW
from tests.planner.simulate.test_prefix_cache import LINEAR, linear_cluster, shared

KV, BATCH, BUDGET = 100_000, 64, 8192


def disagg(woken: list[Worker], trace=(), **kw) -> Routing:
    """Two prefill and two paced decode workers on the linear machine; wakes go to `woken`."""
    c = linear_cluster(prefill_workers=2, decode_workers=2, **kw)
    prefill = [PrefillWorker(i, LINEAR, BUDGET) for i in range(2)]
    decode = [PacedDecodeWorker(j, LINEAR, KV, BATCH, DecodeBatch(ItlSamples()), BUDGET, 0.1)
              for j in range(2)]
    table = PrefixTable(list(trace), c.block_tokens)
    return Routing(c, LINEAR, table, prefill, decode, [], woken.append)


def record(index: int, prompt: int = 1000) -> RequestRecord:
    return RequestRecord(index, 0.0, prompt, 2)


def test_least_loaded_picks_the_lowest_index_among_the_emptiest():
    routing = disagg([])
    routing.loads["decode"] = [3, 3]
    assert routing.pick("decode", record(0)) == 0
    assert routing.pick("decode", record(0), among=[1]) == 1
    routing.loads["decode"] = [4, 3]
    assert routing.pick("decode", record(0)) == 1


def test_the_prefix_policy_goes_where_the_router_sent_the_prefix():
    trace = [shared(0.0, 7), shared(0.0, 7)]
    routing = disagg([], trace, policy=RoutePolicy.PREFIX)
    first, second = (RequestRecord(i, 0.0, r.prompt_tokens, 2) for i, r in enumerate(trace))
    routing.to_prefill(first, 1)
    routing.prefill[1].queue.clear()  # its leg is done; what the router routed there stays
    assert routing.pick("prefill", second) == 1


def test_route_returns_the_split_to_its_caller_and_queues_a_local_prompt_itself():
    """No worker has reported a rate: the first prompt (200 tokens, under the threshold, nothing
    queued) runs locally (queued on decode worker 0, which is woken); the second (1,000) splits
    to the least loaded prefill worker, left to the caller; both count open on the decode
    worker from now."""
    woken: list[Worker] = []
    routing = disagg(woken, split=SplitRule.MEASURED)
    first, second = record(0, 200), record(1)
    assert routing.route(first, 0) is None
    assert routing.paced[0].backlog_tokens == 200 and woken == [routing.paced[0]]
    assert routing.route(second, 0) == 0
    assert ((first.local, second.local), routing.loads["decode"], len(woken)) == \
        ((True, False), [2, 0], 1)
    routing.split(record(1), 0, 0)
    assert (routing.bound, routing.queued, routing.loads["prefill"]) == ({1: 0}, {1: 1000},
                                                                         [1000, 0])
    assert routing.prefill_ended(record(1), 0) == 0
    assert (routing.bound, routing.queued, routing.loads["prefill"]) == ({}, {}, [0, 0])


def test_the_rule_reads_the_rates_the_workers_report_of_their_own_steps():
    """Decode worker 0 timed 1,000 prompt tokens in 1 s alone (R_m 1,000/s), prefill worker 1
    2,000 in 0.5 s (4,000/s), prefill worker 0 nothing. Until the router's health check reads
    them, the rule for unmeasured workers splits the 1,000-token prompt (over 256 tokens) to
    the least loaded prefill worker, 0. Read: local 1 s, split via worker 1 0.25 s + 8 ms on
    the link: split there. Worker 1's window then fills with steps at 500/s: via worker 0, at
    the mean of the rates reported (750/s), 1.34 s; local (1 leg open: the first prompt; no
    decode step timed, so no chunk: C = U) 1 s: local, once read."""
    routing = disagg([], split=SplitRule.MEASURED)
    routing.paced[0].pacer.record(1000, 0, 1.0)
    routing.prefill[1].steps.record(2000, 0, 0.5)
    assert routing.route(record(0), 0) == 0
    routing.poll()
    assert routing.route(record(1), 0) == 1
    for _ in range(WINDOW):
        routing.prefill[1].steps.record(500, 0, 1.0)
    assert routing.prefill[1].steps.rates().prefill_tokens_per_s == 500.0
    assert routing.route(record(2), 0) == 1  # what the last check read
    routing.poll()
    assert routing.route(record(3), 0) is None


def test_every_load_closed_leaves_nothing_over():
    routing = disagg([], split=SplitRule.LOCAL)
    assert routing.route(record(0), 1) is None
    assert routing.leftovers() == ["decode worker 1: load 1"]
    routing.close("decode", 1)
    assert routing.leftovers() == []


class FakeLoop:
    """The loop's side of the gate: its clock, scheduled expiries, freed clients."""

    def __init__(self) -> None:
        self.now = 5.0
        self.expiries: list[tuple[float, str, int]] = []
        self.freed: list[float] = []

    def expire_at(self, time: float, pool: str, record: RequestRecord) -> None:
        self.expiries.append((time, pool, record.index))

    def client_free(self, now: float) -> None:
        self.freed.append(now)


def test_the_gate_routes_grants_queues_with_an_expiry_and_refuses_past_the_queue():
    c = linear_cluster(admission=Admission(max_inflight_per_worker=1, max_queue=1,
                                           max_queue_wait_s=2.0))
    worker = CollocatedWorker(0, LINEAR, KV, BATCH, BUDGET, None, DecodeBatch(ItlSamples()))
    routing = Routing(c, LINEAR, PrefixTable.empty(), [], [], [worker], lambda w: None)
    loop = FakeLoop()
    gate = AdmissionGate(c.admission, c, Layout.COLLOC, routing, loop)
    first, second, third = record(0), record(1), record(2)
    for r in (first, second, third):
        gate.arrive(r, loop.now)
    assert list(worker.waiting) == [first] and routing.loads["colloc"] == [1]
    assert loop.expiries == [(7.0, "decode", 1)]  # the second waits 2 s at most
    assert (third.refused, third.refused_s, loop.freed) == (QUEUE_FULL, 5.0, [5.0])
    routing.close("colloc", 0)
    gate.release("decode", first, 6.0, 102)  # the waiter gets the slot
    assert list(worker.waiting) == [first, second] and gate.leftovers() == [
        "decode pool: request 1 holds a slot"]
