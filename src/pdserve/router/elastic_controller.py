"""The elastic controller: every `interval_s` it observes the pools, asks `elastic.py` whether a
worker should change role, and flips it through `RoleFlips` (the path of the admin endpoint,
which keeps its refusals: never the last worker of a role with work, never a worker already
flipping). `pdserve_role_flips_total` and `pdserve_worker_role` count its flips as they count
an operator's (`pool_metrics.py`).

The observation is the router's own view: each worker's role, phase, legs in flight and its
signed /health report (`rates`, KV blocks), the dispatcher's prefill backlog per worker, and the
admission queues. The tokens waiting for a prefill slot are the prefill queue's depth times the
mean prompt of the pool's completed prefills (0 before one completed). The controller measures
what one instant cannot show: the prompts (and their uncached tokens) the dispatcher sent each
worker to prefill over the arrival window (`elastic_window.py`, sampled once at start and at
every tick), from which `elastic.py` takes arrival rates.

Lifetime: one per router started with `--elastic`, from `start()` (after the dispatcher
exists) to `stop()`; the loop awaits each flip, so flips never overlap, and ticks pause while
one drains. A failed or refused flip is logged and starts the cool-down like a done one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from pdserve.api.errors import ApiError
from pdserve.router.admission import AdmissionQueue
from pdserve.router.elastic import FlipPlan, Memory, Observation, WorkerView, decide, tally
from pdserve.router.elastic_settings import ElasticSettings
from pdserve.router.elastic_window import ArrivalWindow, Window
from pdserve.router.flips import RoleFlips
from pdserve.router.split_decision import PrefillBacklog, Sent, Speed
from pdserve.router.worker_pool import WorkerHandle, WorkerPool

log = logging.getLogger("pdserve.router")


def observe(pool: WorkerPool, queues: Mapping[str, AdmissionQueue], backlog: PrefillBacklog,
            now: float, window: Window | None = None) -> Observation:
    """One observation of the pools (see the module docstring), with the arrivals of
    `window` (none: no rate is known)."""
    prefill = queues["prefill"]
    mean_prompt = prefill.capacity.mean_tokens or 0.0
    window = window or Window()
    return Observation(
        now=now, workers=tuple(_view(w, backlog.tokens(w.key), window.sent.get(w.key, Sent()))
                               for w in pool.workers),
        prefill_waiting_tokens=round(prefill.depth * mean_prompt),
        prefill_demand=prefill.depth + sum(prefill.held(w) for w in pool.workers),
        decode_waiting=queues["decode"].depth, window_s=window.seconds)


def _view(w: WorkerHandle, backlog_tokens: int, sent: Sent) -> WorkerView:
    speed = Speed.of(w.info, backlog_tokens, w.inflight)
    return WorkerView(key=w.key, role=w.role, routable=w.routable, phase=w.phase,
                      inflight=w.inflight, backlog_tokens=backlog_tokens,
                      prefill_tokens_per_s=speed.prefill_tokens_per_s,
                      decode_step_s=speed.decode_step_s,
                      kv_used=_count(w.info.get("kv_blocks_used")),
                      kv_total=_count(w.info.get("kv_blocks_total")),
                      sent_prompts=sent.prompts, sent_tokens=sent.tokens)


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


class ElasticController:
    def __init__(self, pool: WorkerPool, queues: Mapping[str, AdmissionQueue],
                 backlog: PrefillBacklog, flips: RoleFlips, settings: ElasticSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool, self.queues, self.backlog, self.flips = pool, queues, backlog, flips
        self.settings, self.clock = settings, clock
        self.memory = Memory()
        self.arrivals = ArrivalWindow()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        s = self.settings
        log.info("elastic pools on: every %g s, TTFT target %.0f ms, TPOT target %.0f ms, "
                 "%d ticks of pressure, %g s cool-down", s.interval_s, s.ttft_target_s * 1e3,
                 s.tpot_target_s * 1e3, s.sustain_ticks, s.cooldown_s)
        self.arrivals.sample(self.clock(), self.backlog.sent())
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def tick(self) -> FlipPlan | None:
        """One observation and, if the rules say so, one flip (awaited); the plan made."""
        now = self.clock()
        self.arrivals.sample(now, self.backlog.sent())
        s = self.settings
        obs = observe(self.pool, self.queues, self.backlog, now,
                      self.arrivals.window(s.sustain_ticks * s.interval_s))
        self.memory = tally(self.memory, obs, self.settings)
        plan = decide(obs, self.memory, self.settings)
        worker = self.pool.find(plan.worker) if plan is not None else None
        if plan is None or worker is None:
            return None
        log.info("elastic: flipping worker %s %s -> %s: %s", worker.key, worker.role, plan.to,
                 plan.reason)
        try:
            await self.flips.flip(worker, plan.to)
        except ApiError as e:
            log.warning("elastic: flip of worker %s to %s not done (%d): %s", worker.key,
                        plan.to, e.status, e.message)
        finally:
            self.memory = self.memory.flipped(self.clock())
        return plan

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self.tick()
            except Exception:  # a bug in one tick must not end the controller
                log.exception("elastic: tick failed")
