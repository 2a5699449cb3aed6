"""A worker's Prometheus metrics (vLLM's meanings, `pdserve_` names)."""

from __future__ import annotations

import time
from collections.abc import Callable

from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestOutput
from pdserve.metrics import Registry

_SIZE_BUCKETS = (2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28)


class WorkerMetrics:
    def __init__(self, role: str) -> None:
        """`role`: the worker's role at start; `flipped` follows every change."""
        self.registry = r = Registry()
        self.role = r.gauge("pdserve_worker_role", "1 for the role the worker has now, 0 for "
                            "the roles it had before.", ["role"])
        self.role.set(1, role=role)
        self.role_flips = r.counter("pdserve_role_flips_total",
                                    "Live role changes that completed.", ["from", "to"])
        self.role_flip_seconds = r.histogram("pdserve_role_flip_seconds",
                                             "From a role-change command to serving in the new "
                                             "role (the drain included).")
        self.role_flip_timeouts = r.counter("pdserve_role_flip_timeouts_total",
                                            "Role changes given up because the drain outlasted "
                                            "its timeout (the role stayed).")
        self.legs = r.counter("pdserve_legs_total", "Legs accepted, by kind.", ["kind"])
        self.requests = r.counter("pdserve_request_success_total",
                                  "Finished requests, by finish reason.", ["finish_reason"])
        self.handed_back = r.counter(
            "pdserve_legs_handed_back_total",
            "Running legs handed back to the router by a role change, to continue on another "
            "worker with their KV.")
        self.cancelled = r.counter("pdserve_requests_cancelled_total",
                                   "Legs cancelled because the client or router went away.")
        self.recomputes = r.counter("pdserve_kv_recomputes_total",
                                    "Decode legs whose KV transfer failed and that recomputed "
                                    "the prompt locally.")
        self.prompt_tokens = r.counter("pdserve_prompt_tokens_total", "Prompt tokens finished.")
        self.generation_tokens = r.counter("pdserve_generation_tokens_total",
                                           "Output tokens produced.")
        self.ttft = r.histogram("pdserve_time_to_first_token_seconds",
                                "From a leg's arrival (handed to the engine loop) to its first "
                                "output token.")
        self.itl = r.histogram("pdserve_inter_token_latency_seconds",
                               "Between consecutive output tokens of one leg.")
        self.e2e = r.histogram("pdserve_e2e_request_latency_seconds",
                               "From a leg's arrival to its last token.")
        self.step = r.histogram("pdserve_engine_step_seconds", "One engine step.")
        self.transfer_bytes = r.counter("pdserve_transfer_bytes_total",
                                        "KV bytes moved by finished transfers.", ["direction"])
        self.transfer_seconds = r.histogram("pdserve_transfer_seconds",
                                            "Sender side: from token 0 (session open) to the "
                                            "receiver's ACK, successful transfers.")
        self.kv_wait = r.histogram("pdserve_kv_wait_seconds",
                                   "Receiver side: from the reservation to verified KV "
                                   "(includes the prefill's queue and compute).")
        self.layers_streamed = r.counter("pdserve_kv_layers_streamed_total",
                                         "Prefill side: layers of a prompt handed to its "
                                         "transfer while later layers computed.")
        self.transfer_failures = r.counter("pdserve_transfer_failures_total",
                                           "Transfers that failed.", ["direction"])
        self.transfer_size = r.histogram("pdserve_transfer_size_bytes", "KV bytes per transfer.",
                                         ["direction"], buckets=_SIZE_BUCKETS)

    def bind_engine(self, engine: Engine, num_legs: Callable[[], int]) -> None:
        """Gauges read from the engine's load at scrape time."""
        r, load = self.registry, engine.load
        r.gauge("pdserve_kv_blocks_used", "KV blocks held by requests.",
                fn=lambda: load().kv_blocks_used)
        r.gauge("pdserve_kv_blocks_total", "KV blocks in the pool.",
                fn=lambda: load().kv_blocks_total)
        r.gauge("pdserve_kv_cache_usage_perc", "Fraction of KV blocks held (0-1).",
                fn=lambda: load().kv_usage)
        r.gauge("pdserve_num_requests_running", "Requests in the running batch.",
                fn=lambda: load().running)
        r.gauge("pdserve_num_requests_waiting", "Requests queued for prefill.",
                fn=lambda: load().waiting)
        r.gauge("pdserve_num_requests_waiting_for_kv",
                "Decode requests reserved or queued for blocks, waiting for their KV.",
                fn=lambda: load().waiting_for_kv)
        r.gauge("pdserve_num_legs", "Legs streaming or transferring.", fn=num_legs)

    def bind_transport(self, peers_lost: Callable[[], int]) -> None:
        """Gauges read from the KV transport at scrape time."""
        self.registry.gauge("pdserve_transfer_peers_lost",
                            "Peer workers the KV transport holds unreachable now (a partition, "
                            "a host that stopped answering) until it dials them again; their "
                            "transfers end at once and the decode side recomputes.",
                            fn=peers_lost)

    def flipped(self, old: str, new: str, seconds: float) -> None:
        self.role.set(0, role=old)
        self.role.set(1, role=new)
        self.role_flips.inc(**{"from": old, "to": new})
        self.role_flip_seconds.observe(seconds)

    def observe_step(self, seconds: float) -> None:
        self.step.observe(seconds)

    def observe_tokens(self, arrived: float, last: float | None, now: float, n: int) -> None:
        if last is None:
            self.ttft.observe(now - arrived)
        else:
            self.itl.observe(now - last)
        self.generation_tokens.inc(n)

    def observe_finished(self, arrived: float, out: RequestOutput) -> None:
        self.e2e.observe(time.perf_counter() - arrived)
        self.requests.inc(finish_reason=out.outputs[0].finish_reason or "abort")
        self.prompt_tokens.inc(len(out.prompt_token_ids))

    def observe_transfer(self, ok: bool, seconds: float, nbytes: int, direction: str) -> None:
        if not ok:
            self.transfer_failures.inc(direction=direction)
            return
        self.transfer_bytes.inc(nbytes, direction=direction)
        if direction == "send":
            self.transfer_seconds.observe(seconds)
        else:
            self.kv_wait.observe(seconds)
        self.transfer_size.observe(nbytes, direction=direction)
