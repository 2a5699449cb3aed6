"""The simulated cluster: its layout, worker counts and per-worker limits, how its router routes
and admits, and whether a trace can run on it at all.

Layouts:
- disagg: `prefill_workers` prefill workers and `decode_workers` decode workers. A request's
  token 0 comes at the end of its prefill step (TTFT does not wait for the KV transfer); its
  KV then travels for link_fixed_s + transfer_seconds(KV bytes per GPU of the prompt,
  link_gbps) (kv_math, each rank ships its own shard at once) and it joins its decode worker's
  admission queue. link_fixed_s is what a hand-over costs whatever its bytes (the transfer's
  messages and the two legs' events, what the router's link estimate calls its fixed part,
  router/link_estimates.py); the router's split decision prices the link the same way.
- colloc: `collocated_workers` workers doing both, prefill first (decodes stall for prefills).
- chunked: the same workers with chunked prefill of at most `chunk_tokens` prompt tokens per step.
Every layout: `frontend_latency_s` is the round trip between a client and the worker serving it
(the router and HTTP on the way there and back, half each way: a request reaches its worker
half of it after it was sent, and the client sees each token half of it after its step ended).
It adds to TTFT and E2E latency, not to ITL, and it sets when a closed loop's next request
reaches a worker: a whole round trip after the step that ended the last one, never in time for
the very next step.
Worker rules are in pools.py, step costs in calibration.py, routing in routing.py, admission in
admission.py and admission_gate.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from pdserve.planner.kv_math import check_link, kv_bytes, transfer_seconds
from pdserve.planner.plan import DEFAULT_MAX_DECODE_BATCH, PREFILL_BATCH_TOKENS
from pdserve.planner.simulate.admission import Admission
from pdserve.planner.simulate.split_model import BLOCK_TOKENS, DEFAULT_TPOT_TARGET_S, SplitRule
from pdserve.planner.simulate.trace import TraceRequest

DEFAULT_CHUNK_TOKENS = 2048  # our default prefill tokens per chunked step


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


def _check_seconds(value: object, field: str, flag: str) -> None:
    """A duration that may be 0: a finite number of seconds >= 0, else ValueError naming
    the field and its flag."""
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not 0 <= value < math.inf:
        raise ValueError(f"{field} ({flag}) must be a number of seconds >= 0, got {value!r}")


@dataclass(frozen=True)
class Cluster:
    """Worker counts and per-worker limits; KV sizes in tokens and bytes per GPU; how a split
    layout routes its prompts (`split`, split_model.py) and the TPOT target its decode workers
    pace local prefills to (the router's `--slo-tpot-ms`); the KV block (`block_tokens`, the
    engine's `block_size`, default 16: a prefix cache reuses whole blocks only) and how the
    router picks workers (`policy`: routing.py); the router's back-pressure (`admission`,
    admission.py; None: none, every request is served)."""

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
    itl_target_s: float | None = None  # the paced steps' ceiling (--slo-itl-ms); None: TPOT
    ttft_target_s: float | None = None  # paced steps run to the ceiling while a prompt misses it
    block_tokens: int = BLOCK_TOKENS
    policy: RoutePolicy = RoutePolicy.LEAST_LOADED
    admission: Admission | None = None
    frontend_latency_s: float = 0.0
    link_fixed_s: float = 0.0  # a hand-over's cost whatever its bytes (--link-fixed-ms)

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
        itl = self.itl_target_s
        if itl is not None and (isinstance(itl, bool) or not isinstance(itl, int | float)
                                or not self.tpot_target_s <= itl < math.inf):
            raise ValueError(f"itl_target_s (--slo-itl-ms) must be at least tpot_target_s "
                             f"({self.tpot_target_s!r} s), got {self.itl_target_s!r}")
        ttft = self.ttft_target_s
        if ttft is not None and (isinstance(ttft, bool) or not isinstance(ttft, int | float)
                                 or not 0 < ttft < math.inf):
            raise ValueError(f"ttft_target_s must be a positive number of seconds, got {ttft!r}")
        _check_seconds(self.frontend_latency_s, "frontend_latency_s", "--frontend-latency-ms")
        _check_seconds(self.link_fixed_s, "link_fixed_s", "--link-fixed-ms")
        if self.admission is not None and not isinstance(self.admission, Admission):
            raise ValueError(f"admission must be an Admission or None, got {self.admission!r}")

    def transfer_seconds(self, prompt_tokens: int) -> float:
        """A hand-over of a prompt of `prompt_tokens`: the fixed part, then the wire."""
        return self.link_fixed_s + transfer_seconds(
            kv_bytes(self.kv_bytes_per_token_rank, prompt_tokens), self.link_gbps)


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
