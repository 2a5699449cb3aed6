"""The router's admission (back-pressure) in the simulator: per-worker in-flight caps, a bounded
FIFO queue per pool in front of them, and the requests it refuses.

What the router does (router/admission.py, admission_settings.py, capacity.py, dispatch.py):
- Two pools, each with its own queue: "decode" (decode and collocated workers) and "prefill"
  (prefill workers). A request first takes a slot in the decode pool, on the worker the routing
  policy picks among those with room; if its path is split, it then takes a slot in the prefill
  pool, both within one `--max-queue-wait-s` from its arrival. Its legs go out only once it
  holds every slot its path needs.
- What counts against a worker's cap: the requests holding a slot on it, one per request, not
  per leg. A decode-pool slot is held from its grant until the whole request ends (its last
  token, or its failure); a prefill-pool slot from its grant until the prefill leg's final
  event (token 0; the KV then moves without the leg). A split request thus counts once on its
  decode worker and once, while it prefills, on its prefill worker.
- Queued: when no worker of the pool has room, or others already wait (FIFO: a newcomer never
  overtakes a waiter). Each freed slot goes at once to the oldest waiter.
- Refused: a request that finds the queue holding its capacity gets 429 (`queue_full`) at once;
  one that waits its whole allowance gets 503 (`queue_timeout`) at that moment. Nothing holding
  a slot is refused. A split request refused by the prefill pool gives its decode slot back.
- Default cap of a worker: `--max-inflight-per-worker`, else min(B, max(1, floor(K / T))), B
  the worker's batch limit (max_num_seqs), K its KV pool in tokens (kv_blocks_total x
  block_size), T the mean KV tokens of the pool's last 64 completed requests (prompt +
  completion tokens; prompt tokens in the prefill pool); B until a request completed.
- Default queue size: `--max-queue`, else floor(mu x max wait), at most 1,024, where mu = C / S,
  C the sum of the pool's caps and S the mean service time (grant to release) of its last 64
  completions, 1 s before the first (Little's law). Both defaults move as completions come in.
- A refused request, to a client: an HTTP error (429 or 503, Retry-After) and no token. bench
  serve counts it as failed: out of every latency statistic, the token totals, throughput and
  goodput, but its end counts in the duration; a closed-loop client sends its next request at
  once (bench/serve/runner.py).

What the simulator models: all of the above, with the router's measured defaults derived from
the simulated completions and the cluster's limits (B = `Cluster.max_batch`, K =
`Cluster.kv_capacity_tokens` in whole blocks), so that `Admission()` is a router started with
its defaults. Not modelled: Retry-After (a bench client does not wait for it), workers leaving
the pools (restarts, breakers), moves of a slot after a failure, a client going away while it
waits. A freed slot goes to the oldest waiter in the same instant; a waiter whose allowance ends
in the instant a slot frees gets the slot (releases are processed before expiries).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.planner.simulate.metrics import RequestRecord

# The router's constants (router/admission_settings.py and capacity.py; the planner may not
# import the router, tests/planner/simulate/test_admission.py checks that they agree).
DEFAULT_MAX_QUEUE_WAIT_S = 30.0
WINDOW = 64  # completions the measured means are taken over
UNMEASURED_SERVICE_S = 1.0
MAX_QUEUE = 1024
QUEUE_FULL, QUEUE_TIMEOUT = 429, 503  # the HTTP status of each refusal


def _is_int(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


@dataclass(frozen=True)
class Admission:
    """The router's admission flags; None: the router's measured default (module docstring).
    A wait of math.inf (the simulator only) never refuses a waiter."""

    max_inflight_per_worker: int | None = None
    max_queue: int | None = None
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S

    def __post_init__(self) -> None:
        if self.max_inflight_per_worker is not None and \
                not _is_int(self.max_inflight_per_worker, 1):
            raise ValueError(f"max_inflight_per_worker (--max-inflight-per-worker) must be an "
                             f"integer >= 1, got {self.max_inflight_per_worker!r}")
        if self.max_queue is not None and not _is_int(self.max_queue, 0):
            raise ValueError(f"max_queue (--max-queue) must be an integer >= 0, got "
                             f"{self.max_queue!r}")
        wait = self.max_queue_wait_s
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not wait > 0:
            raise ValueError(f"max_queue_wait_s (--max-queue-wait-s) must be a number of "
                             f"seconds > 0, got {wait!r}")

    def describe(self) -> str:
        cap = self.max_inflight_per_worker
        queue = self.max_queue
        return (f"at most {cap if cap is not None else 'min(max batch, KV / mean request)'} "
                f"requests per worker; queue "
                f"{queue if queue is not None else 'completions/s x wait'} per pool; "
                f"wait <= {self.max_queue_wait_s:g} s")


Choose = Callable[[RequestRecord, list[int]], int]
Granted = Callable[[RequestRecord, int], None]
Refused = Callable[[RequestRecord, int], None]


@dataclass(eq=False)
class _Waiter:
    record: RequestRecord
    expires_s: float


class AdmissionPool:
    """One pool's slots and queue. `choose(record, free)` picks a worker index among those with
    room (the routing policy); `granted(record, worker)` hands the request on; `refused(record,
    status)` ends it. The event loop's gate (admission_gate.py) calls `acquire` when a request
    asks for a slot, `release` when it gives one back, and `expire` at the time `acquire`
    returned.

    Invariants: a grant leaves held[i] <= cap (a cap that measurement shrinks below what a
    worker holds only stops its grants); `waiting` is oldest first, and non-empty only while no
    worker has room (or in the instant before `admit_waiting`); `granted_at` maps each request
    holding a slot to (its worker, its grant time); sum(held) == len(granted_at).
    Lifetime: one per pool per simulated run."""

    def __init__(self, name: str, workers: int, admission: Admission, batch_limit: int,
                 kv_tokens: int, choose: Choose, granted: Granted, refused: Refused) -> None:
        self.name, self.admission = name, admission
        self.batch_limit, self.kv_tokens = batch_limit, kv_tokens
        self.choose, self.granted, self.refused = choose, granted, refused
        self.held = [0] * workers
        self.granted_at: dict[int, tuple[int, float]] = {}
        self.waiting: dict[int, _Waiter] = {}  # request index -> waiter; insertion order
        self._service: deque[float] = deque(maxlen=WINDOW)
        self._tokens: deque[int] = deque(maxlen=WINDOW)

    # -- the router's capacity arithmetic (router/capacity.py) --------------------------------

    def cap(self) -> int:
        """Requests one worker is given at once."""
        if self.admission.max_inflight_per_worker is not None:
            return self.admission.max_inflight_per_worker
        if not self._tokens or self.kv_tokens <= 0:
            return self.batch_limit
        mean = sum(self._tokens) / len(self._tokens)
        return min(self.batch_limit, max(1, math.floor(self.kv_tokens / mean)))

    def queue_capacity(self) -> int:
        if self.admission.max_queue is not None:
            return self.admission.max_queue
        service = sum(self._service) / len(self._service) if self._service else \
            UNMEASURED_SERVICE_S
        rate = max(self.cap() * len(self.held), 1) / max(service, 1e-3)
        waited = rate * self.admission.max_queue_wait_s
        return MAX_QUEUE if waited >= MAX_QUEUE else math.floor(waited)

    def free(self) -> list[int]:
        cap = self.cap()
        return [i for i, n in enumerate(self.held) if n < cap]

    # -- requests -------------------------------------------------------------------------------

    def acquire(self, record: RequestRecord, now: float, wait_s: float) -> float | None:
        """Grants a slot at once, refuses (429) or queues `record`; returns the time `expire`
        must be called at for a queued one (None otherwise)."""
        self.admit_waiting(now)
        if not self.waiting and (free := self.free()):
            self._grant(record, free, now)
            return None
        if len(self.waiting) >= self.queue_capacity():
            self.refused(record, QUEUE_FULL)
            return None
        expires = now + max(wait_s, 0.0)
        self.waiting[record.index] = _Waiter(record, expires)
        return expires

    def release(self, record: RequestRecord, now: float, tokens: int | None) -> None:
        """`record` gives its slot back; `tokens` (the KV tokens it held) says it completed and
        is measured, None that it failed. No-op for a request holding no slot here."""
        held = self.granted_at.pop(record.index, None)
        if held is None:
            return
        worker, since = held
        self.held[worker] -= 1
        if tokens is not None:
            self._service.append(max(now - since, 0.0))
            self._tokens.append(max(tokens, 1))
        self.admit_waiting(now)

    def expire(self, record: RequestRecord, now: float) -> None:
        """The waiting allowance of `record` ended: 503 if it still waits."""
        waiter = self.waiting.get(record.index)
        if waiter is not None and waiter.expires_s <= now:
            del self.waiting[record.index]
            self.refused(record, QUEUE_TIMEOUT)

    def admit_waiting(self, now: float) -> None:
        """Grants free slots to the oldest waiters."""
        while self.waiting and (free := self.free()):
            index = next(iter(self.waiting))
            self._grant(self.waiting.pop(index).record, free, now)

    def _grant(self, record: RequestRecord, free: list[int], now: float) -> None:
        worker = self.choose(record, free)
        if worker not in free:
            raise RuntimeError(f"{self.name} pool: worker {worker} has no free slot")
        self.held[worker] += 1
        self.granted_at[record.index] = (worker, now)
        self.granted(record, worker)

    def leftovers(self) -> list[str]:
        """What a finished run still holds here: nothing, unless the model lost track."""
        left = [f"{self.name} pool: request {i} holds a slot" for i in self.granted_at]
        return left + [f"{self.name} pool: request {i} waits" for i in self.waiting]
