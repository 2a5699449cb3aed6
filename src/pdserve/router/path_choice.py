"""The router's choice between the split path and a local prefill, per request, and the
measurements it needs: the prompt tokens each worker still has to prefill (`PrefillBacklog`)
and the KV link's speed (`LinkEstimate`), both learnt from the router's own legs.

Rule (`split_decision.py` has the formulas): a fixed `--local-prefill-threshold` when one is
given (uncached tokens at most that run locally); else the measured-cost decision, which falls
back to UNMEASURED_THRESHOLD until the workers have reported their rates.

Lifetime: one per dispatcher; every method runs on the router's event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.router.split_decision import (
    Decision,
    LinkEstimate,
    PrefillBacklog,
    Speed,
    decide,
    kv_bytes_per_token,
)
from pdserve.router.worker_pool import WorkerHandle, WorkerPool

# Until the rates are measured: prompts whose uncached part is at most this run locally (the
# fixed rule's old default; a few hundred tokens are a short stall on any hardware).
UNMEASURED_THRESHOLD = 256


@dataclass(frozen=True)
class Choice:
    split: bool
    why: str
    decision: Decision | None = None  # the measured-cost decision, when one was made


class PathChoice:
    def __init__(self, pool: WorkerPool, threshold: int | None, tpot_target_s: float) -> None:
        self.pool, self.threshold, self.tpot_target_s = pool, threshold, tpot_target_s
        self.backlog = PrefillBacklog()
        self.link = LinkEstimate()

    def choose(self, decode: WorkerHandle, uncached: int, prefill: list[WorkerHandle]
               ) -> Choice:
        """Whether `uncached` prompt tokens on `decode` go to one of `prefill` (not empty)."""
        if self.threshold is not None:
            return Choice(uncached > self.threshold,
                          f"{uncached} uncached tokens, --local-prefill-threshold "
                          f"{self.threshold}")
        decision = decide(uncached, self.kv_bytes_per_token, self._speed(decode),
                          [self._speed(p) for p in prefill], self.link, self.tpot_target_s)
        if decision is None:
            return Choice(uncached > UNMEASURED_THRESHOLD,
                          f"{uncached} uncached tokens; rates not measured yet, fixed rule "
                          f"({UNMEASURED_THRESHOLD})")
        return Choice(not decision.local, decision.reason, decision)

    def prefilling(self, worker: WorkerHandle, tokens: int) -> Callable[[], None]:
        """A leg that prefills `tokens` went to `worker`; call the result at its first event or
        its end."""
        return self.backlog.add(worker.key, tokens)

    def handed_over(self, tokens: int, seconds: float) -> None:
        """A split request's KV for `tokens` prompt tokens took `seconds` from the prefill's
        token 0 to the decode leg's first event."""
        self.link.observe(tokens * self.kv_bytes_per_token, seconds)

    @property
    def kv_bytes_per_token(self) -> int:
        layout = (self.pool.reference or {}).get("kv_layout")
        return kv_bytes_per_token(layout) if isinstance(layout, dict) else 0

    def _speed(self, worker: WorkerHandle) -> Speed:
        return Speed.of(worker.info, self.backlog.tokens(worker.key), worker.inflight)
