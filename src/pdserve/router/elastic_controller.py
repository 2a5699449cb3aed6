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
exists and the pool's first health round; the first tick comes at once, so that a pair at rest
is merged before the first prompts) to `stop()`; the loop awaits each flip, so flips never
overlap, and ticks pause while one drains. A failed or refused flip is logged and starts the
cool-down like a done one. A pressure sustained long enough that the rules keep every worker
under (`Hold`: the other side's headroom, the last worker of a role) is logged with the
reason, at most every HOLD_LOG_S per kind of pressure: a warning, or information for an idle
prefill side kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from pdserve.api.errors import ApiError
from pdserve.router.admission import AdmissionQueue
from pdserve.router.core_lending import CoreLending, cpus_of
from pdserve.router.elastic import (
    DECODE_CAPABLE,
    FlipPlan,
    Hold,
    Memory,
    Observation,
    WorkerView,
    tally,
)
from pdserve.router.elastic_lending import (
    LendPlan,
    LoanMemory,
    Plan,
    ReclaimPlan,
    choose,
    tally_loans,
)
from pdserve.router.elastic_settings import ElasticSettings
from pdserve.router.elastic_window import ArrivalWindow, Window
from pdserve.router.flips import RoleFlips
from pdserve.router.split_decision import PrefillBacklog, Sent, Speed, local_rate
from pdserve.router.worker_pool import WorkerHandle, WorkerPool
from pdserve.throttled_log import ThrottledLog

log = logging.getLogger("pdserve.router")
# A pressure the rules keep every worker under (`Hold`) is said at most this often per kind,
# while it lasts: the operator learns why nothing flips without a line per tick.
HOLD_LOG_S = 30.0
PRESSURES = {"prefill": "prefill pressure", "decode": "decode pressure",
             "idle": "an idle prefill side beside busy decoders"}  # Hold.pressure, in words


def observe(pool: WorkerPool, queues: Mapping[str, AdmissionQueue], backlog: PrefillBacklog,
            now: float, window: Window | None = None,
            borrows: Callable[[WorkerHandle], bool] = lambda w: False) -> Observation:
    """One observation of the pools (see the module docstring), with the arrivals of
    `window` (none: no rate is known) and the workers that compute on lent cores."""
    prefill = queues["prefill"]
    mean_prompt = prefill.capacity.mean_tokens or 0.0
    window = window or Window()
    prompt = typical_prompt(window, mean_prompt)
    return Observation(
        now=now, workers=tuple(_view(w, backlog.tokens(w.key), window.sent.get(w.key, Sent()),
                                     prompt, borrows) for w in pool.workers),
        prefill_waiting_tokens=round(prefill.depth * mean_prompt),
        prefill_demand=prefill.depth + sum(prefill.held(w) for w in pool.workers),
        decode_waiting=queues["decode"].depth, window_s=window.seconds)


def typical_prompt(window: Window, mean_prompt: float) -> int:
    """The uncached prompt a decode-capable worker's rate is priced for: the mean of the
    prompts sent to prefill within the window, else the mean of the pool's completed
    prefills; 0 when neither is known."""
    sent = window.sent.values()
    prompts = sum(s.prompts for s in sent)
    if prompts:
        return round(sum(s.tokens for s in sent) / prompts)
    return round(mean_prompt)


def stage_rate(role: str, speed: Speed, prompt: int) -> float | None:
    """R_w, the rate at which w would prefill what the stage sends it. A prefill worker runs
    whole prompts alone: its measured `prefill_tokens_per_s`. A decode-capable worker
    prefills beside the legs it has open: R_d, the rate its split decision counts on for a
    prompt of `prompt` tokens (`split_decision.local_rate`, from its marginal rate R_m and its
    decode step), R_m itself for a prompt of unknown length and no chunk; its average where
    it reports no R_m. (Its average keeps the streams that ran beside its last local prompts,
    however long ago; R_d counts those open now.)"""
    r_m = speed.prefill_marginal_tokens_per_s
    if role not in DECODE_CAPABLE or r_m is None:
        return speed.prefill_tokens_per_s
    uncached = prompt if prompt > 0 else speed.chunk_tokens
    return local_rate(speed, uncached, r_m)[0] if uncached else r_m


def _view(w: WorkerHandle, backlog_tokens: int, sent: Sent, prompt: int,
          borrows: Callable[[WorkerHandle], bool]) -> WorkerView:
    speed = Speed.of(w.info, backlog_tokens, w.inflight)
    host = w.info.get("host")
    return WorkerView(key=w.key, role=w.role, routable=w.routable, phase=w.phase,
                      inflight=w.inflight, backlog_tokens=backlog_tokens,
                      prefill_tokens_per_s=stage_rate(w.role, speed, prompt),
                      decode_step_s=speed.decode_step_s,
                      kv_used=_count(w.info.get("kv_blocks_used")),
                      kv_total=_count(w.info.get("kv_blocks_total")),
                      sent_prompts=sent.prompts, sent_tokens=sent.tokens,
                      host=host if isinstance(host, str) else None,
                      cpus=cpus_of(w) or (), borrowing=borrows(w))


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


class ElasticController:
    def __init__(self, pool: WorkerPool, queues: Mapping[str, AdmissionQueue],
                 backlog: PrefillBacklog, flips: RoleFlips, lending: CoreLending,
                 settings: ElasticSettings, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.pool, self.queues, self.backlog, self.flips = pool, queues, backlog, flips
        self.lending, self.settings, self.clock = lending, settings, clock
        self.memory = Memory()
        self.loans = LoanMemory()
        self.arrivals = ArrivalWindow()
        # pressure no flip relieves is a warning; an idle prefill side kept is information
        self._holds = {"prefill": ThrottledLog(log, HOLD_LOG_S, clock),
                       "decode": ThrottledLog(log, HOLD_LOG_S, clock),
                       "idle": ThrottledLog(log, HOLD_LOG_S, clock, logging.INFO)}
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

    async def tick(self) -> Plan | None:
        """One observation and, if the rules say so, one change (a flip, a loan of cores or
        their reclaim; awaited); the plan made."""
        now = self.clock()
        self.arrivals.sample(now, self.backlog.sent())
        s = self.settings
        obs = observe(self.pool, self.queues, self.backlog, now,
                      self.arrivals.window(s.sustain_ticks * s.interval_s), self.lending.borrows)
        self.memory = tally(self.memory, obs, s)
        self.loans = tally_loans(self.loans, obs, s)
        plan = choose(obs, self.memory, self.loans, s)
        if isinstance(plan, Hold):
            self._say(plan)
            return None
        worker = self.pool.find(plan.worker) if plan is not None else None
        if plan is None or worker is None:
            return None
        try:
            await self._make(plan, worker)
        except ApiError as e:
            log.warning("elastic: %s not done (%d): %s", _what(plan, worker), e.status, e.message)
        finally:
            self.memory, self.loans = self.memory.flipped(self.clock()), LoanMemory()
        return plan

    async def _make(self, plan: Plan, worker: WorkerHandle) -> None:
        log.info("elastic: %s: %s", _what(plan, worker), plan.reason)
        if isinstance(plan, FlipPlan):
            await self.flips.flip(worker, plan.to)
        elif isinstance(plan, LendPlan):
            borrower = self.pool.find(plan.to)
            if borrower is None:
                raise ApiError(404, f"worker {plan.to} left the pool")
            await self.lending.lend(worker, borrower)
        else:
            await self.lending.reclaim(worker)

    def _say(self, hold: Hold) -> None:
        self._holds[hold.pressure].warn(hold.pressure, "elastic: %s for %d ticks, no flip: %s",
                                        PRESSURES[hold.pressure],
                                        self.memory.ticks(hold.pressure), hold.reason)

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # a bug in one tick must not end the controller
                log.exception("elastic: tick failed")
            await asyncio.sleep(self.settings.interval_s)


def _what(plan: Plan, worker: WorkerHandle) -> str:
    """The change in words, for the log."""
    if isinstance(plan, FlipPlan):
        return f"flipping worker {worker.key} {worker.role} -> {plan.to}"
    if isinstance(plan, LendPlan):
        return f"lending worker {worker.key}'s cores to worker {plan.to}"
    assert isinstance(plan, ReclaimPlan)
    return f"taking worker {worker.key}'s cores back"
