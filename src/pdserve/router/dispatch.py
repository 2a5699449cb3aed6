"""The router's request path: pick local or disaggregated, send the legs, merge their events,
and move the request when a worker fails it.

Local path (no prefill pool, or conditional disaggregation chose a local prefill:
`path_choice.py`, from measured costs or a fixed `--local-prefill-threshold`): one LOCAL leg on
a decode or collocated worker.

Disaggregated path: a random 64-bit transfer id; the PREFILL leg (to a prefill worker, naming
the decode worker's transfer endpoint) and the DECODE leg (naming the prefill's) are sent at
once. Token 0 comes from the prefill leg as soon as it is sampled; the decode leg repeats it
and continues (the caller drops repeated positions). If token 0 finished the request, the
decode leg is closed at once.

The fallback chain, when a worker fails a request (a leg lost, timed out, or ended with the
worker's error; never when the worker refused the request as the client's fault, 4xx):
1. A prefill leg that fails before either leg spoke: the legs go again, once, to another
   healthy prefill worker with the same decode worker; else (or if that fails too) the request
   runs as a LOCAL leg on the decode slot's worker (it prefills itself). A prefill leg that
   fails after a leg spoke needs nothing: the decode worker's transfer fails too (peer death or
   lease) and it recomputes locally. If the decode leg says it recomputed while the prefill leg
   never spoke, the prefill worker is stalled or cut off and is marked failed at once.
2. A local or decode leg that fails moves the request to a healthy decode or collocated worker
   it has not tried: from the start if no token reached the client, else as a continuation
   (`migration.py`: the prompt plus the tokens the client has, `max_tokens` reduced, the same
   seed, sampling at the original output positions; its events shifted so the client's stream
   only pauses). At most `max_migrations` moves a request, each after a pause
   (`retry_backoff_s` doubling, at most 1 s).
   With no such worker but one expected back (restarting after a crash, behind an open
   breaker), the request waits for the first to serve again, within `--max-queue-wait-s`.
3. Then the request fails: an error response, or, once the stream started, an error event
   and `[DONE]`.
A leg its worker hands back (a final event with `extra.moved`: the worker became a prefill
worker, `workers/role_flip.py`) is no failure: the request continues split, from just before
the last token the client has, with its prefill leg on that worker resuming the parked leg
(`LegRequest.resume`: the leg's own KV is sent, nothing computed, and that token repeated as
token 0) and its decode leg on another decode worker, the KV moved as for any split request;
on a collocated worker it continues locally. A decode leg handed back before its KV came (a
reservation: its final event at position 0, nothing parked) starts over from where its legs
began, with another decode worker and the same prefill worker, whose own leg the decode side's
hand-back ends (also `extra.moved`, no failure); tokens the client has are repeated and
checked. This counts against neither the breaker nor `max_migrations`, only against
`MAX_HAND_BACKS`.
Each move's legs carry `<request id>.<n>`: the worker that failed may still hold the first.
Known limits of a continuation: its worker recomputes the prompt and the tokens sent, and
prefill arithmetic may differ from decode's in the last bits; a repeated token that differs
from the one sent ends the stream with an error (`Diverged`). A stop string that spans the
move is found by the router (`migration.Relay`); `logprobs` of the repeated tokens are not
compared.

Circuit breakers (`breaker.py`): every worker marked failed (`WorkerPool.mark_failed`) counts
against its breaker; an open breaker takes the worker out of the admission pools (requests wait
in the queue rather than fail), a half-open one lets one probe leg through.

Admission (`admission.py`): a request first waits for a slot in the decode pool (decode and
collocated workers; the chooser picks the path's worker among those with room; also while
none is healthy but one is expected back, e.g. restarting after a crash), then, if it is
split, for a slot in the prefill pool, both within one `--max-queue-wait-s`; its legs go out
only once it holds every slot its path needs. The prefill slot frees when the prefill leg
ends, the decode slot when the request does. A move elsewhere moves the slot, never waits.

Every request that may sample gets a seed here when it has none: a recompute, a retry or a
continuation then draws exactly the tokens the first attempt would have.

Events travel in batches (those a leg delivered together), so the client gets them in one write.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from pdserve.common.block_hash import hash_blocks
from pdserve.common.sampling_params import SamplingParams
from pdserve.legs.protocol import MOVED, EventBatch, LegKind, LegRequest, TokenEvent
from pdserve.router.admission import AdmissionQueue, Slot
from pdserve.router.admission_settings import AdmissionSettings
from pdserve.router.breaker import Breakers, BreakerSettings
from pdserve.router.leg_client import LegFailed, RouterLegChannels
from pdserve.router.migration import Delivered, Diverged, WorkerFailed, continuation
from pdserve.router.path_choice import Choice, PathChoice, Prompt
from pdserve.router.policies import Policy
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.worker_pool import WorkerHandle, WorkerPool

log = logging.getLogger("pdserve.router")

MAX_BACKOFF_S = 1.0
COMEBACK_POLL_S = 0.1  # how often a request waiting for a worker to serve again looks
MAX_HAND_BACKS = 16  # a request handed back more often fails (workers flipping without end)


@dataclass(frozen=True)
class DispatchSettings:
    # uncached prompt tokens run locally at or under this; None: decided from measured costs
    local_prefill_threshold: int | None = None
    slo_tpot_s: float = 0.1  # a local prefill may not make a decode worker's steps longer
    connect_timeout_s: float = 5.0
    leg_timeout_s: float = 60.0  # longest silence on a leg before it counts as failed
    block_size: int = 16  # for prefix hashes until the cluster's block size is known
    max_migrations: int = 2  # moves of a request to another worker after a failure
    retry_backoff_s: float = 0.05  # the pause before a request's first move; doubles
    breaker: BreakerSettings = field(default_factory=BreakerSettings)

    def __post_init__(self) -> None:
        if self.local_prefill_threshold is not None and self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0 tokens")
        for name in ("connect_timeout_s", "leg_timeout_s", "slo_tpot_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds")
        if type(self.max_migrations) is not int or self.max_migrations < 0:
            raise ValueError(f"max_migrations must be an int >= 0 (0: never move a request), "
                             f"got {self.max_migrations!r}")
        if not self.retry_backoff_s >= 0:
            raise ValueError(f"retry_backoff_s must be >= 0 seconds, got "
                             f"{self.retry_backoff_s!r}")


class NoWorkers(Exception):
    """No healthy worker can serve the request now (HTTP 503)."""


class _HandedBack(Exception):
    """`worker` handed the request's leg `leg_id` back after the tokens the client has (it
    changed role), its KV parked there for a resumed PREFILL leg; or, with `restart` (an
    output position), a DECODE leg whose KV had not come, nothing parked: the next attempt
    begins where those legs began, its prefill on `prefill` if it still takes prompts."""

    def __init__(self, worker: WorkerHandle, leg_id: str, restart: int | None = None,
                 prefill: WorkerHandle | None = None) -> None:
        super().__init__(f"{worker.name} handed the request back")
        self.worker, self.leg_id, self.restart, self.prefill = worker, leg_id, restart, prefill


class _PrefillLost(Exception):
    """The prefill leg failed before either leg spoke: the split can start over."""

    def __init__(self, worker: WorkerHandle, error: LegFailed) -> None:
        super().__init__(str(error))
        self.worker = worker


@dataclass(eq=False)
class _Run:
    """One admitted request across its attempts; `slot` is its decode pool slot, whose worker
    runs the decode side; `tried` the decode-side workers that failed it."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    hashes: list[int]
    slot: Slot
    delivered: Delivered = field(default_factory=Delivered)
    tried: list[WorkerHandle] = field(default_factory=list)
    moves: int = 0
    hand_backs: int = 0
    prefill_retries: int = 0
    attempts: int = 0
    prefilled_once: bool = False  # a leg that prefills went out (later ones are no arrival)
    arrived: float = field(default_factory=time.monotonic)  # when the router took it

    def waited(self, leg: LegRequest) -> LegRequest:
        """`leg` with the time this request has waited so far (`LegRequest.waited_s`)."""
        return dataclasses.replace(leg, waited_s=time.monotonic() - self.arrived)

    def next_leg_id(self) -> str:
        self.attempts += 1
        return self.request_id if self.attempts == 1 else f"{self.request_id}.{self.attempts}"


class Dispatcher:
    def __init__(self, pool: WorkerPool, policy: Policy, settings: DispatchSettings,
                 channels: RouterLegChannels, metrics: RouterMetrics,
                 admission: AdmissionSettings | None = None) -> None:
        self.pool, self.policy, self.settings = pool, policy, settings
        self.channels, self.metrics = channels, metrics
        self.admission = admission or AdmissionSettings()
        self.paths = PathChoice(pool, settings.local_prefill_threshold, settings.slo_tpot_s,
                                metrics)
        self.breakers = Breakers(settings.breaker)
        self.queues = {"decode": AdmissionQueue("decode", self._serving, self.admission, metrics,
                                                expected=self._expected),
                       "prefill": AdmissionQueue("prefill", lambda: self._routable("prefill"),
                                                 self.admission, metrics)}
        pool.on_refresh = self.admit_waiting
        pool.on_failed = self.breakers.failed
        for queue in self.queues.values():
            metrics.add_publisher(queue.publish)
        metrics.add_publisher(lambda: self.breakers.publish(metrics, pool.workers))

    def admit_waiting(self) -> None:
        """After a health round or a probe's success: a worker that came back takes waiting
        requests."""
        for queue in self.queues.values():
            queue.admit_waiting()

    async def generate(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                       on_choice: Callable[[Choice], None] | None = None
                       ) -> AsyncIterator[EventBatch]:
        """Token events of one request from any legs, in batches; the last event is final.
        `on_choice` is told the request's path once it is chosen, before its first event.
        Raises LegFailed (its `client_error` says whose fault), NoWorkers or Overloaded."""
        if params.seed is None and not params.greedy:
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        hashes = hash_blocks(prompt, self._block_size)
        arrived = time.monotonic()
        if not self._serving() and not self._coming_back():
            raise NoWorkers("no healthy decode or collocated worker")
        deadline = time.monotonic() + self.admission.max_queue_wait_s
        slot = await self.queues["decode"].acquire(
            lambda free: self._choose(free, len(prompt), hashes), len(prompt))
        generated: int | None = None  # set once the final event went out: a completion
        try:
            run = _Run(request_id, tuple(prompt), params, hashes, slot, arrived=arrived)
            async with contextlib.aclosing(self._admitted(run, deadline, on_choice)) as batches:
                async for batch in batches:  # closed first: the legs go before the slot
                    if batch[-1].final:
                        generated = _end(batch)
                    yield batch
        finally:
            slot.release(generated)

    async def _admitted(self, run: _Run, deadline: float,
                        on_choice: Callable[[Choice], None] | None
                        ) -> AsyncIterator[EventBatch]:
        """The request on the worker of its decode slot, split (after a prefill slot) or whole,
        then wherever the fallback chain moves it."""
        choice = self._path(run.slot.worker, len(run.prompt), run.hashes)
        self.paths.record(choice)
        if on_choice is not None:
            on_choice(choice)
        log.debug("request %s: %s on %s: %s", run.request_id, choice.path,
                  run.slot.worker.name, choice.why)
        if choice.split:
            pre = await self.queues["prefill"].acquire(
                lambda free: self._prefill_worker(run, choice, free), len(run.prompt),
                deadline - time.monotonic())
            attempt = self._disaggregated(run, pre)
        else:
            attempt = self._local(run)
        self.metrics.requests.inc(path=choice.path)
        while True:
            try:
                async with contextlib.aclosing(attempt) as batches:
                    async for batch in batches:
                        run.delivered.add(batch)
                        yield batch
                return
            except WorkerFailed as failed:
                attempt = self._move(run, failed)
            except _HandedBack as back:
                attempt = self._hand_back(run, back)

    @property
    def _block_size(self) -> int:
        return self.pool.block_size or self.settings.block_size

    def _routable(self, role: str) -> list[WorkerHandle]:
        """Healthy workers of `role` whose breakers let a new request through."""
        return [w for w in self.pool.healthy(role) if self.breakers.allows(w)]

    def _serving(self) -> list[WorkerHandle]:
        """The decode pool: workers that can run a request whole or decode it."""
        return self._routable("collocated") + self._routable("decode")

    def _expected(self) -> list[WorkerHandle]:
        """The decode pool's workers that serve or are expected to again (not refused)."""
        return [w for w in self.pool.workers
                if w.role in ("decode", "collocated") and w.refused is None]

    def _coming_back(self) -> bool:
        """Whether a decode-capable worker that cannot serve now is expected to (restarting,
        behind an open breaker, flipping): a request then waits for it in the admission queue,
        within `--max-queue-wait-s`, rather than failing at once. One refused for its secret or
        configuration is not expected back."""
        return bool(self._expected())

    def _uncached(self, worker: WorkerHandle, prompt_len: int, hashes: list[int]) -> int:
        return prompt_len - worker.prefix.match(hashes) * self._block_size

    def _moved_tokens(self, prompt_len: int) -> int:
        """The tokens whose KV a split moves: every prompt token, in whole blocks. The decode
        worker reserves blocks for the whole prompt without its prefix cache
        (`Scheduler.reserve_remote`) and the prefill worker sends all of them
        (`HandOver.send_kv`), whatever either side had cached."""
        return -(-prompt_len // self._block_size) * self._block_size

    def _prompt(self, prompt_len: int, hashes: list[int]) -> Prompt:
        """The split decision's view of a prompt: the KV a split moves, and the tokens each
        worker lacks (by this router's prefix index of it)."""
        return Prompt(self._moved_tokens(prompt_len),
                      lambda worker: self._uncached(worker, prompt_len, hashes))

    def _path(self, worker: WorkerHandle, prompt_len: int, hashes: list[int]) -> Choice:
        """Conditional disaggregation (`path_choice.py`): only a decode worker with a prefill
        pool beside it may split."""
        return self.paths.choose(worker, self._prompt(prompt_len, hashes),
                                 self._routable("prefill"))

    def _choose(self, free: list[WorkerHandle], prompt_len: int, hashes: list[int]
                ) -> WorkerHandle:
        """A new request's worker among those with room: the decode worker the policy picks
        if the request would be split there, else the policy's pick of them all."""
        decode = [w for w in free if w.role == "decode"]
        if decode and self._routable("prefill"):
            dec = self.policy.choose(decode, hashes)
            if self._path(dec, prompt_len, hashes).split:
                return dec
        return self.policy.choose(free, hashes)

    def _prefill_worker(self, run: _Run, choice: Choice, free: list[WorkerHandle]
                        ) -> WorkerHandle:
        """The prefill worker of a split among those with room: after a measured-cost
        decision, the policy's pick of those through which the first token is estimated
        soonest (each one's queue, the prompt's tokens it lacks, its rate and its link to the
        decode worker: a slow link to one prefill host sends the prompt to another); else the
        policy's pick of them all."""
        if choice.decision is not None:
            free = self.paths.fastest_prefill(
                run.slot.worker, self._prompt(len(run.prompt), run.hashes), free)
        return self.policy.choose(free, run.hashes)

    async def _pause(self, moves: int) -> None:
        """Before the n-th move of a request: backoff, growing with n."""
        if moves:
            await asyncio.sleep(min(self.settings.retry_backoff_s * 2 ** (moves - 1),
                                    MAX_BACKOFF_S))

    # -- the fallback chain --------------------------------------------------------------------

    def _move(self, run: _Run, failed: WorkerFailed) -> AsyncIterator[EventBatch]:
        """The next attempt after `failed`: a local leg on a healthy worker the request has
        not tried, from the start or continuing the client's stream; with none, on the first
        decode-capable worker to serve again (a restarted one too) within the queue wait.
        Raises when the request moved `max_migrations` times or no worker is expected."""
        run.tried.append(failed.worker)
        sent = len(run.delivered.token_ids)
        if run.moves >= self.settings.max_migrations:
            raise LegFailed(f"{failed} (the request already moved {run.moves} times)")
        candidates = [w for w in self._serving() if w not in run.tried]
        if not candidates and not self._coming_back():
            if not sent:
                raise NoWorkers("no healthy decode or collocated worker")
            raise LegFailed(f"{failed}; no other healthy worker to continue on")
        run.moves += 1
        reason = f"{failed.kind} leg failed"
        (self.metrics.migrations if sent else self.metrics.retries).inc(reason=reason)
        return self._moved(run, failed, candidates)

    async def _moved(self, run: _Run, failed: WorkerFailed, candidates: list[WorkerHandle]
                     ) -> AsyncIterator[EventBatch]:
        if not candidates:
            log.warning("request %s: %s; waiting for a decode worker to serve again",
                        run.request_id, failed)
            candidates = await self._serving_again(run, failed, ())
        run.slot.move(self.policy.choose(candidates, run.hashes))
        sent = len(run.delivered.token_ids)
        log.warning("request %s: %s; %s on %s", run.request_id, failed,
                    f"continuing after token {sent}" if sent else "retrying",
                    run.slot.worker.name)
        async with contextlib.aclosing(self._local(run)) as local:
            async for batch in local:
                yield batch

    async def _serving_again(self, run: _Run, failed: Exception,
                             exclude: Sequence[WorkerHandle]) -> list[WorkerHandle]:
        """The decode-capable workers but `exclude` that serve, once one does (a restarted
        worker is back after its model loads: seconds). After the queue wait: NoWorkers if the
        client has no token yet, else the stream ends with `failed`."""
        deadline = time.monotonic() + self.admission.max_queue_wait_s
        while not (serving := [w for w in self._serving() if w not in exclude]):
            if time.monotonic() >= deadline or not self._coming_back():
                within = f"within {self.admission.max_queue_wait_s:g} s"
                if run.delivered.token_ids:
                    raise LegFailed(f"{failed}; no other healthy worker to continue on (none "
                                    f"came back {within})")
                raise NoWorkers(f"no healthy decode or collocated worker came back {within}")
            await asyncio.sleep(COMEBACK_POLL_S)
        return serving

    async def _hand_back(self, run: _Run, back: _HandedBack) -> AsyncIterator[EventBatch]:
        """The next attempt after a worker handed the request back: split, with the prefill on
        that worker resuming the parked KV and the decode on another decode worker; local on a
        collocated one, or when that prefill leg fails before either leg spoke. A reservation
        handed back (`back.restart`) starts over from where its legs began, split with the
        same prefill worker if it still takes prompts (else the policy's pick), or local."""
        source = back.worker
        run.hand_backs += 1
        if run.hand_backs > MAX_HAND_BACKS:
            raise LegFailed(f"the request was handed back {MAX_HAND_BACKS} times by workers "
                            f"changing role")
        self.metrics.migrations.inc(reason="handed back by a worker changing role")
        candidates = [w for w in self._serving() if w is not source]
        if not candidates:
            candidates = await self._serving_again(run, back, (source,))
        run.slot.move(self.policy.choose(candidates, run.hashes))
        dec = run.slot.worker
        log.info("request %s: %s handed it back after token %d (changing role); continuing on "
                 "%s", run.request_id, source.name, len(run.delivered.token_ids), dec.name)
        pre, resume = (source, back.leg_id) if back.restart is None else \
            (self._prefill_for(run, back.prefill), None)
        if dec.role == "decode" and pre is not None and pre.peer is not None:
            try:
                async with contextlib.aclosing(
                        self._split_legs(run, pre, None, resume, back.restart)) as legs:
                    async for batch in legs:
                        yield batch
                return
            except _PrefillLost as lost:
                self.metrics.retries.inc(reason="prefill leg failed, local prefill")
                log.warning("request %s: %s; prefilling on %s", run.request_id, lost, dec.name)
        async with contextlib.aclosing(self._local(run, back.restart)) as local:
            async for batch in local:
                yield batch

    def _prefill_for(self, run: _Run, last: WorkerHandle | None) -> WorkerHandle | None:
        """The prefill worker of a restarted split: `last` while it takes prompts (what it
        computed of the prompt is in its prefix cache), else the policy's pick; None: none."""
        routable = self._routable("prefill")
        if last in routable:
            return last
        return self.policy.choose(routable, run.hashes) if routable else None

    # -- local -------------------------------------------------------------------------------

    async def _local(self, run: _Run, before: int | None = None) -> AsyncIterator[EventBatch]:
        """One LOCAL leg on the decode slot's worker: the request whole, or its continuation
        after the tokens the client has (from output token `before` at the latest). Raises
        WorkerFailed when the worker fails it."""
        await self._pause(run.moves)
        worker = run.slot.worker
        leg, relay = continuation(run.next_leg_id(), run.prompt, run.params, run.delivered,
                                  before)
        leg = run.waited(leg)
        leg_hashes = hash_blocks(leg.prompt_token_ids, self._block_size) \
            if leg.output_offset else run.hashes
        prefilled = self.paths.prefilling(
            worker, self._uncached(worker, len(leg.prompt_token_ids), leg_hashes),
            arrival=not run.prefilled_once)
        run.prefilled_once = True
        worker.prefix.add(leg_hashes)
        try:
            async with contextlib.aclosing(self._leg(worker, leg)) as batches:
                async for batch in batches:
                    prefilled()
                    batch, moved = _without_moved(batch)
                    batch, error = relay(batch)
                    if batch:
                        yield batch
                        if batch[-1].final:  # the worker's, or a stop string across the move
                            return
                    if error is not None:
                        raise WorkerFailed(worker, LegKind.LOCAL, LegFailed(error))
                    if moved is not None:
                        raise _HandedBack(worker, leg.request_id)
        except LegFailed as e:
            if isinstance(e, Diverged) or (e.client_error and not run.delivered.token_ids):
                raise
            raise WorkerFailed(worker, LegKind.LOCAL, e) from e
        finally:
            prefilled()

    # -- disaggregated -----------------------------------------------------------------------

    async def _disaggregated(self, run: _Run, pre_slot: Slot) -> AsyncIterator[EventBatch]:
        """Split legs on the prefill slot's and the decode slot's workers; a prefill leg that
        fails before either leg spoke is replaced (step 1 of the chain)."""
        try:
            while True:
                try:
                    async with contextlib.aclosing(
                            self._split_legs(run, pre_slot.worker, pre_slot)) as legs:
                        async for batch in legs:
                            yield batch
                    return
                except _PrefillLost as lost:
                    if not self._prefill_elsewhere(run, pre_slot, lost):
                        break
                await self._pause(run.prefill_retries)
        finally:
            pre_slot.release()
        async with contextlib.aclosing(self._local(run)) as local:
            async for batch in local:
                yield batch

    def _prefill_elsewhere(self, run: _Run, pre_slot: Slot, lost: _PrefillLost) -> bool:
        """Moves the prefill slot to another healthy prefill worker (once per request); False:
        none, the decode worker prefills itself."""
        others = [w for w in self._routable("prefill") if w is not lost.worker]
        if run.prefill_retries or not others:
            self.metrics.retries.inc(reason="prefill leg failed, local prefill")
            log.warning("request %s: %s; prefilling on %s", run.request_id, lost,
                        run.slot.worker.name)
            return False
        run.prefill_retries += 1
        pre_slot.move(self.policy.choose(others, run.hashes))
        self.metrics.retries.inc(reason="prefill leg failed, another prefill worker")
        log.warning("request %s: %s; prefilling on %s", run.request_id, lost,
                    pre_slot.worker.name)
        return True

    async def _split_legs(self, run: _Run, pre: WorkerHandle, pre_slot: Slot | None,
                          resume: str | None = None, before: int | None = None
                          ) -> AsyncIterator[EventBatch]:
        """One prefill leg on `pre` and one decode leg on the decode slot's worker, merged: the
        request from the start, or its continuation after the tokens the client has (from
        output token `before` at the latest). A hand-back's (`resume`: the leg `pre` handed
        back; no prefill slot) starts before the last token the client has, whose KV that
        worker never computed: its prefill leg sends the parked KV and repeats that token as
        token 0. Raises _PrefillLost, _HandedBack (a decode leg handed back before any token
        of its own: with `restart`, these legs' start), or WorkerFailed when the decode leg
        fails."""
        dec = run.slot.worker
        tid = secrets.randbits(64) or 1
        if resume is not None:
            before = max(len(run.delivered.token_ids) - 1, 0)
        leg, relay = continuation(run.next_leg_id(), run.prompt, run.params, run.delivered,
                                  before)
        leg = run.waited(leg)
        ids = leg.prompt_token_ids
        hashes = hash_blocks(ids, self._block_size) if leg.output_offset else run.hashes
        kv_tokens = self._moved_tokens(len(ids))  # the KV that moves: the whole prompt's
        prefilled = self.paths.prefilling(pre, self._uncached(pre, len(ids), hashes),
                                          arrival=not run.prefilled_once)
        run.prefilled_once = True
        pre.prefix.add(hashes)
        dec.prefix.add(hashes)
        token0_at: float | None = None
        legs = {
            "prefill": (pre, dataclasses.replace(leg, kind=LegKind.PREFILL, transfer_id=tid,
                                                 peer=dec.peer, resume=resume)),
            "decode": (dec, dataclasses.replace(leg, kind=LegKind.DECODE, transfer_id=tid,
                                                peer=pre.peer)),
        }
        merged: asyncio.Queue = asyncio.Queue()
        slots = {"prefill": pre_slot, "decode": None}
        tasks = {name: asyncio.create_task(self._pump(name, w, leg, merged, slots[name]))
                 for name, (w, leg) in legs.items()}
        ended, heard, spoke = set(), set(), set()
        try:
            while len(ended) < len(tasks):
                name, item = await merged.get()
                if item is None:
                    ended.add(name)
                    continue
                moved = None
                if not isinstance(item, LegFailed):
                    item, moved = _without_moved(item)
                if name == "decode" and "prefill" not in heard and _recomputed(item):
                    self._prefill_silent(run.request_id, pre)
                if name == "prefill":
                    prefilled()
                    if moved is not None:
                        continue  # its decode leg was handed back: that leg says so
                    if token0_at is None and not isinstance(item, LegFailed):
                        token0_at = time.monotonic()
                elif name not in heard and token0_at is not None and \
                        not isinstance(item, LegFailed) and not _recomputed(item):
                    self.paths.handed_over(pre, dec, kv_tokens, time.monotonic() - token0_at)
                heard.add(name)
                if name == "prefill" and not isinstance(item, LegFailed) and item[-1].error:
                    item = LegFailed(item[-1].error)  # the prefill worker's own error
                if isinstance(item, LegFailed):
                    if item.client_error:
                        raise item
                    if name == "decode":
                        raise WorkerFailed(dec, LegKind.DECODE, item)
                    if not spoke:
                        raise _PrefillLost(pre, item)
                    log.warning("request %s: %s; decode recomputes", run.request_id, item)
                    self.metrics.retries.inc(reason="prefill leg failed")
                    if pre_slot is not None:
                        pre_slot.release()
                    continue
                spoke.add(name)
                batch, error = _relayed(name, item)
                batch, _ = relay(batch)  # no error is left in it
                if batch:
                    yield batch
                    if batch[-1].final:
                        return
                if error is not None:
                    raise WorkerFailed(dec, LegKind.DECODE, LegFailed(error))
                if moved == 0:  # a reservation: nothing parked
                    raise _HandedBack(dec, legs["decode"][1].request_id, leg.output_offset, pre)
                if moved is not None:
                    raise _HandedBack(dec, legs["decode"][1].request_id)
            raise LegFailed("both legs ended without finishing the request")
        finally:
            prefilled()
            for task in tasks.values():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks.values(), return_exceptions=True)

    def _prefill_silent(self, request_id: str, pre: WorkerHandle) -> None:
        """The decode worker gave up waiting for the KV (its lease) and recomputed, and the
        prefill leg never spoke: the prefill worker is stalled or unreachable. New prompts stop
        going to it now rather than after three missed health checks; the next health check
        it answers brings it back."""
        self.pool.mark_failed(pre, "its KV never reached the decode worker and its prefill leg "
                                   "stayed silent")
        self.metrics.retries.inc(reason="prefill silent, decode recomputed")
        log.warning("request %s: %s sent no KV and no token; the decode worker recomputed",
                    request_id, pre.name)

    async def _pump(self, name: str, worker: WorkerHandle, leg: LegRequest,
                    merged: asyncio.Queue, slot: Slot | None) -> None:
        """Relays one leg; its own slot (the prefill's) frees when the leg ends with its final
        event (after a failure the caller moves or frees it)."""
        try:
            async for batch in self._leg(worker, leg):
                merged.put_nowait((name, batch))
                if slot is not None and batch[-1].final:
                    # measured only when it prefilled: a prefill holds the prompt's KV only
                    prefilled = batch[-1].error is None and not batch[-1].extra.get(MOVED)
                    slot.release(0 if prefilled else None)
        except LegFailed as e:
            merged.put_nowait((name, e))
        merged.put_nowait((name, None))

    # -- one leg -------------------------------------------------------------------------------

    async def _leg(self, worker: WorkerHandle, leg: LegRequest) -> AsyncIterator[EventBatch]:
        """The leg's batches, judging its worker: a leg lost, timed out, or ended with the
        worker's error marks it failed (its breaker counts it); one that ended with its final
        event is a success; a client's error, or a leg closed early, is neither."""
        probe = self.breakers.started(worker)
        succeeded = False
        try:
            async for batch in self.channels.stream(worker, leg, self.settings.leg_timeout_s):
                if batch[-1].final:
                    error = _worker_error(batch[-1])
                    succeeded = error is None
                    if error is not None:
                        self.pool.mark_failed(worker, error)
                yield batch
        except LegFailed as e:
            if not e.client_error:
                self.pool.mark_failed(worker, str(e))
            raise
        finally:
            self.breakers.ended(worker, succeeded, probe)
            if probe and succeeded:
                self.admit_waiting()


def _worker_error(event: TokenEvent) -> str | None:
    """The worker's error that ended its leg; a decode leg ended because token 0 finished the
    request on the prefill side (`prefill_finished`) is no failure."""
    return None if event.extra.get("prefill_finished") else event.error


def _without_moved(batch: EventBatch) -> tuple[EventBatch, int | None]:
    """The batch without the event that hands the leg back (always the last: it ends the
    leg), and that event's position in the leg (the tokens the leg sent); None: none."""
    if batch and batch[-1].extra.get(MOVED):
        return batch[:-1], batch[-1].index
    return batch, None


def _recomputed(item: EventBatch | LegFailed) -> bool:
    return not isinstance(item, LegFailed) and any(e.extra.get("recomputed") for e in item)


def _end(batch: EventBatch) -> int:
    """The output position after the batch's last token."""
    return batch[-1].index + len(batch[-1].token_ids)


def _relayed(leg: str, batch: EventBatch) -> tuple[EventBatch, str | None]:
    """What of a disaggregated request's batch from `leg` goes to the client, up to the final
    event; and the decode leg's error, if one of its events reports it (what came before it
    still goes). The prefill leg's error is dropped (the decode leg reports its own side), and so
    is the decode leg's `prefill_finished` event (the prefill leg's final event ends the
    request). Token 0 from the prefill leg ends the request only if it finished it."""
    out: EventBatch = []
    for event in batch:
        if leg == "prefill":
            if event.error is not None:
                continue
            event.final = event.finish_reason is not None  # else decode carries on
        elif event.extra.get("prefill_finished"):
            continue
        elif event.error is not None:
            return out, event.error
        out.append(event)
        if event.final:
            break
    return out, None
