"""What one pool of workers can take, from measurement: each worker's in-flight cap, the rate
at which the pool's queue drains, the queue's size, and the Retry-After of a refusal.

Measured over the pool's last `WINDOW` completed requests (a request that failed or whose
client went away is not a completion): the mean service time S (from the grant of a slot to
its release) and the mean KV tokens T a request holds (prompt + completion tokens; prompt
tokens in the prefill pool, whose workers hold only the prompt's KV).

- cap(worker) = `--max-inflight-per-worker`, else min(B, max(1, floor(K / T))): B is the
  worker's batch limit (`max_num_seqs` in its signed /health; the worker's default, 64, when
  it does not say), K its KV pool in tokens (`kv_blocks_total` x `block_size` of its signed
  /health). Beyond B a leg only waits inside the worker; beyond K / T the worker's pool
  overflows, and a decode reservation that waits for room, or a finished prefill that waits
  for its reservation, runs down its KV lease and ends in a recompute. Before T is measured:
  B.
- drain rate mu = C / S, C the sum of the pool's healthy workers' caps. Little's law
  (L = lambda W; J. D. C. Little, Operations Research 9(3), 1961) for the slots of a saturated
  pool, L = C and W = S: it completes C / S requests a second, and that is the rate at which
  its queue moves. Before S is measured, S = 1 s: optimistic on purpose, so that until the
  first completions the queue errs towards waiting (what happened without admission) rather
  than refusing.
- queue capacity Q = `--max-queue`, else floor(mu x max wait), at most `MAX_QUEUE`: Little's
  law for the queue, Q waiting requests leave it in Q / mu seconds, so the last of a full
  queue is admitted in about the max wait.
- Retry-After = (depth + 1) / mu seconds: the queue as it is now drained, plus one place.

Lifetime: one per pool per router; the event loop's only.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from pdserve.router.admission_settings import AdmissionSettings

WINDOW = 64  # completions the means are taken over
DEFAULT_BATCH_LIMIT = 64  # `pdserve worker --max-num-seqs`'s default, for workers not saying
UNMEASURED_SERVICE_S = 1.0
# Every waiting request holds its prompt's ids (a full 8,192-token context is ~0.3 MB as a
# Python list), so the measured size is bounded: 1,024 places, ~300 MB at worst.
MAX_QUEUE = 1024


class PoolCapacity:
    def __init__(self, settings: AdmissionSettings) -> None:
        self.settings = settings
        self._service: deque[float] = deque(maxlen=WINDOW)
        self._tokens: deque[int] = deque(maxlen=WINDOW)

    def record(self, service_s: float, tokens: int) -> None:
        """One completed request: its slot's service time and the KV tokens it held."""
        self._service.append(max(service_s, 0.0))
        self._tokens.append(max(tokens, 1))

    @property
    def mean_service_s(self) -> float:
        return sum(self._service) / len(self._service) if self._service else \
            UNMEASURED_SERVICE_S

    @property
    def mean_tokens(self) -> float | None:
        return sum(self._tokens) / len(self._tokens) if self._tokens else None

    def worker_cap(self, info: Mapping[str, Any]) -> int:
        """Requests the worker with these signed /health details is given at once."""
        if self.settings.max_inflight_per_worker is not None:
            return self.settings.max_inflight_per_worker
        cap = _positive_int(info.get("max_num_seqs"), DEFAULT_BATCH_LIMIT)
        kv_tokens = _positive_int(info.get("kv_blocks_total"), 0) * \
            _positive_int(info.get("block_size"), 0)
        tokens = self.mean_tokens
        if tokens is not None and kv_tokens > 0:
            cap = min(cap, max(1, math.floor(kv_tokens / tokens)))
        return cap

    def drain_rate(self, slots: int) -> float:
        """Requests a second the pool admits from its queue while every slot is taken."""
        return max(slots, 1) / max(self.mean_service_s, 1e-3)

    def queue_capacity(self, caps: Iterable[int]) -> int:
        if self.settings.max_queue is not None:
            return self.settings.max_queue
        waited = self.drain_rate(sum(caps)) * self.settings.max_queue_wait_s
        return min(MAX_QUEUE, math.floor(waited))

    def retry_after_s(self, depth: int, caps: Iterable[int]) -> float:
        """Seconds until a request sent now would likely be admitted."""
        return (depth + 1) / self.drain_rate(sum(caps))


def _positive_int(value: object, default: int) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else default
