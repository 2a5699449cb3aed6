"""The router's Prometheus metrics: what the client saw, end to end."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.metrics import Registry
from pdserve.router.worker_pool import WorkerPool


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = Registry()
        self.requests = r.counter("pdserve_router_requests_total",
                                  "Requests routed, by path (local or disaggregated).", ["path"])
        self.responses = r.counter("pdserve_router_responses_total",
                                   "Responses by HTTP status (a stream that ended with an error "
                                   "event counts as 500).", ["status"])
        self.retries = r.counter("pdserve_router_retries_total",
                                 "Legs that failed and were retried or recomputed, by reason.",
                                 ["reason"])
        self.migrations = r.counter("pdserve_router_migrations_total", "Streams continued on "
                                    "another worker after tokens reached the client, by the "
                                    "failed leg's kind.", ["reason"])
        self.breaker_state = r.gauge("pdserve_router_worker_breaker_state", "The worker's "
                                     "circuit breaker: 0 closed, 1 half-open (one probe), 2 "
                                     "open (no new requests).", ["worker", "role"])
        self.ttft = r.histogram("pdserve_router_time_to_first_token_seconds",
                                "From request arrival to the first token sent to the client.")
        self.itl = r.histogram("pdserve_router_inter_token_latency_seconds",
                               "Between consecutive tokens sent to the client.")
        self.e2e = r.histogram("pdserve_router_e2e_request_latency_seconds",
                               "From request arrival to the last byte sent.")
        self._add_admission(r)
        self._add_split(r)
        self._publishers: list[Callable[[], None]] = []

    def _add_admission(self, r: Registry) -> None:
        """Back-pressure (`admission.py`), per pool: prefill, or decode (decode and collocated
        workers)."""
        self.queue_depth = r.gauge("pdserve_router_queue_depth", "Requests waiting at the "
                                   "router for a worker's slot.", ["pool"])
        self.queue_capacity = r.gauge("pdserve_router_queue_capacity", "Places in the queue "
                                      "(--max-queue, or the drain rate times "
                                      "--max-queue-wait-s).", ["pool"])
        self.drain_rate = r.gauge("pdserve_router_queue_drain_rate", "Requests a second the "
                                  "pool completes while full: its slots over the measured "
                                  "mean service time.", ["pool"])
        self.admitted = r.counter("pdserve_router_admitted_total", "Requests given a worker's "
                                  "slot.", ["pool"])
        self.rejected = r.counter("pdserve_router_rejected_total", "Requests refused by "
                                  "admission: queue_full (429), queue_timeout (503).",
                                  ["pool", "reason"])
        self.queue_wait = r.histogram("pdserve_router_queue_wait_seconds", "From arrival at "
                                      "the pool's queue to the grant of a slot.", ["pool"])
        self.worker_cap = r.gauge("pdserve_router_worker_inflight_cap", "Requests the worker "
                                  "is given at once (--max-inflight-per-worker, or its batch "
                                  "and KV limits).", ["worker", "role"])

    def _add_split(self, r: Registry) -> None:
        """Conditional disaggregation (`path_choice.py`): one count and, for a measured-cost
        decision, one estimate of each path per request."""
        self.split_decisions = r.counter(
            "pdserve_router_split_decisions_total", "Requests by the path chosen (local or "
            "disaggregated) and the rule that chose it: collocated_worker, no_prefill_worker, "
            "threshold (--local-prefill-threshold), unmeasured (rates not measured yet: the "
            "workers taken as equally fast), measured_cost (the two paths' estimated times), "
            "tpot_target (a local prefill would break the decode streams' --slo-tpot-ms).",
            ["path", "reason"])
        self.split_estimate = r.histogram(
            "pdserve_router_split_estimate_seconds", "The measured-cost decision's estimated "
            "time to first token of each path (queued and own prompt tokens over the prefill "
            "rate, plus the KV transfer when disaggregated), per request it was made for.",
            ["path"])
        self.split_link_source = r.counter(
            "pdserve_router_split_link_source_total", "Measured-cost decisions by where the "
            "estimate of the link from the fastest prefill worker came from: handovers (the "
            "pair's own recent hand-overs), report (the prefill worker's report of the link), "
            "mean (neither: the mean of the links known), none (no link known: no cost).",
            ["source"])
        self.link_bandwidth = r.gauge(
            "pdserve_router_link_bytes_per_second", "The KV link from a prefill worker to a "
            "decode worker (URLs), learnt from their recent hand-overs: seconds = fixed + "
            "bytes / this; 0 once none is in memory (the link counts at the others' mean) "
            "and while every hand-over in memory is under 512 KiB (a fixed cost only).",
            ["prefill", "decode"])
        self.link_fixed = r.gauge(
            "pdserve_router_link_fixed_seconds", "The fixed part of a hand-over's time on the "
            "link (see pdserve_router_link_bytes_per_second).", ["prefill", "decode"])

    def add_publisher(self, publish: Callable[[], None]) -> None:
        """`publish()` copies some state into the metrics before each rendering."""
        self._publishers.append(publish)

    def bind_pool(self, pool: WorkerPool) -> None:
        g = self.registry.gauge("pdserve_router_worker_healthy", "1 if the worker answers "
                                "/health.", ["worker", "role"])
        inflight = self.registry.gauge("pdserve_router_worker_inflight_legs",
                                       "Legs in flight per worker.", ["worker", "role"])
        refused = self.registry.gauge("pdserve_router_worker_refused", "1 if the worker is "
                                      "refused (no proof of the cluster secret, or its model, "
                                      "dtype, context length or KV layout differs).",
                                      ["worker", "role"])
        self._pool, self._healthy, self._inflight = pool, g, inflight
        self._refused = refused

    def refresh(self) -> None:
        """Copy per-worker state into the gauges (called before rendering)."""
        for w in self._pool.workers:
            self._healthy.set(1.0 if w.healthy else 0.0, worker=w.url, role=w.role)
            self._inflight.set(w.inflight, worker=w.url, role=w.role)
            self._refused.set(1.0 if w.refused else 0.0, worker=w.url, role=w.role)
        for publish in self._publishers:
            publish()
