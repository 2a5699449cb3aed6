"""The router's request path: pick local or disaggregated, send the legs, merge their events.

Local path (no prefill pool, or the uncached part of the prompt is at most
`local_prefill_threshold` tokens: conditional disaggregation): one LOCAL leg on a decode or
collocated worker. If it fails before any token reached the client, once more elsewhere.

Disaggregated path: a random 64-bit transfer id; the PREFILL leg (to a prefill worker, naming
the decode worker's transfer endpoint) and the DECODE leg (naming the prefill's) are sent at
once. Token 0 comes from the prefill leg as soon as it is sampled; the decode leg repeats it
and continues (the caller drops repeated positions). If token 0 finished the request, the
decode leg is closed at once. If the prefill leg fails, the decode worker's transfer fails
too (peer death or lease) and it recomputes locally, so the decode leg alone completes the
request; if the decode leg says it recomputed while the prefill leg never spoke, the prefill
worker is stalled or cut off and is marked unhealthy at once (its next answered health check
brings it back). If the decode leg fails before any token reached the client, the request is
retried as a local leg; after that, the stream ends with an error.

Admission (`admission.py`): a request first waits for a slot in the decode pool (decode and
collocated workers; the chooser picks the path's worker among those with room), then, if it is
split, for a slot in the prefill pool, both within one `--max-queue-wait-s`; its legs go out
only once it holds every slot its path needs. The prefill slot frees when the prefill leg
ends, the decode slot when the request does. A retry elsewhere moves the slot, never waits.

Every request that may sample gets a seed here when it has none: a recompute or a retry then
draws exactly the tokens the first attempt would have.

Events travel in batches (those a leg delivered together), so the client gets them in one write.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from pdserve.common.block_hash import hash_blocks
from pdserve.common.sampling_params import SamplingParams
from pdserve.legs.protocol import EventBatch, LegKind, LegRequest
from pdserve.router.admission import AdmissionQueue, Slot
from pdserve.router.admission_settings import AdmissionSettings
from pdserve.router.leg_client import LegFailed, RouterLegChannels
from pdserve.router.policies import Policy
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.worker_pool import WorkerHandle, WorkerPool

log = logging.getLogger("pdserve.router")


@dataclass(frozen=True)
class DispatchSettings:
    local_prefill_threshold: int = 256  # uncached prompt tokens run locally at or under this
    connect_timeout_s: float = 5.0
    leg_timeout_s: float = 60.0  # longest silence on a leg before it counts as failed
    block_size: int = 16  # for prefix hashes until the cluster's block size is known

    def __post_init__(self) -> None:
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0 tokens")
        for name in ("connect_timeout_s", "leg_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds")


class NoWorkers(Exception):
    """No healthy worker can serve the request now (HTTP 503)."""


class Dispatcher:
    def __init__(self, pool: WorkerPool, policy: Policy, settings: DispatchSettings,
                 channels: RouterLegChannels, metrics: RouterMetrics,
                 admission: AdmissionSettings | None = None) -> None:
        self.pool, self.policy, self.settings = pool, policy, settings
        self.channels, self.metrics = channels, metrics
        self.admission = admission or AdmissionSettings()
        self.queues = {"decode": AdmissionQueue("decode", self._serving, self.admission, metrics),
                       "prefill": AdmissionQueue("prefill", lambda: pool.healthy("prefill"),
                                                 self.admission, metrics)}
        pool.on_refresh = self.admit_waiting
        for queue in self.queues.values():
            metrics.add_publisher(queue.publish)

    def admit_waiting(self) -> None:
        """After a health round: a worker that came back takes waiting requests."""
        for queue in self.queues.values():
            queue.admit_waiting()

    async def generate(self, request_id: str, prompt: Sequence[int], params: SamplingParams
                       ) -> AsyncIterator[EventBatch]:
        """Token events of one request from any legs, in batches; the last event is final.
        Raises LegFailed (its `client_error` says whose fault), NoWorkers or Overloaded."""
        if params.seed is None and not params.greedy:
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        hashes = hash_blocks(prompt, self._block_size)
        if not self._serving():
            raise NoWorkers("no healthy decode or collocated worker")
        deadline = time.monotonic() + self.admission.max_queue_wait_s
        slot = await self.queues["decode"].acquire(
            lambda free: self._choose(free, len(prompt), hashes), len(prompt))
        generated: int | None = None  # set once the final event went out: a completion
        try:
            async for batch in self._admitted(request_id, prompt, params, hashes, slot,
                                              deadline):
                if batch[-1].final:
                    generated = _end(batch)
                yield batch
        finally:
            slot.release(generated)

    async def _admitted(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                        hashes: list[int], slot: Slot, deadline: float
                        ) -> AsyncIterator[EventBatch]:
        """The request on the worker of its decode slot: split (after a prefill slot) or
        whole."""
        dec = slot.worker
        if self._split(dec, len(prompt), hashes):
            pre = await self.queues["prefill"].acquire(
                lambda free: self.policy.choose(free, hashes), len(prompt),
                deadline - time.monotonic())
            self.metrics.requests.inc(path="disaggregated")
            async for batch in self._disaggregated(request_id, prompt, params, hashes, pre,
                                                   slot):
                yield batch
            return
        self.metrics.requests.inc(path="local")
        async for batch in self._local(request_id, prompt, params, hashes, slot):
            yield batch

    @property
    def _block_size(self) -> int:
        return self.pool.block_size or self.settings.block_size

    def _serving(self) -> list[WorkerHandle]:
        """The decode pool: workers that can run a request whole or decode it."""
        return self.pool.healthy("collocated") + self.pool.healthy("decode")

    def _uncached(self, worker: WorkerHandle, prompt_len: int, hashes: list[int]) -> int:
        return prompt_len - worker.prefix.match(hashes) * self._block_size

    def _split(self, worker: WorkerHandle, prompt_len: int, hashes: list[int]) -> bool:
        """Conditional disaggregation: a decode worker, a prefill pool, and more uncached
        prompt on that worker than the local-prefill threshold."""
        return (worker.role == "decode" and bool(self.pool.healthy("prefill")) and
                self._uncached(worker, prompt_len, hashes) > self.settings.local_prefill_threshold)

    def _choose(self, free: list[WorkerHandle], prompt_len: int, hashes: list[int]
                ) -> WorkerHandle:
        """A new request's worker among those with room: the decode worker the policy picks
        if the request would be split there, else the policy's pick of them all."""
        decode = [w for w in free if w.role == "decode"]
        if decode and self.pool.healthy("prefill"):
            dec = self.policy.choose(decode, hashes)
            if self._split(dec, prompt_len, hashes):
                return dec
        return self.policy.choose(free, hashes)

    # -- local -------------------------------------------------------------------------------

    async def _local(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                     hashes: list[int], slot: Slot, tried: Sequence[WorkerHandle] = ()
                     ) -> AsyncIterator[EventBatch]:
        """On the slot's worker; a retry (`tried` not empty) moves the slot to another one."""
        if tried:
            candidates = [w for w in self._serving() if w not in tried]
            if not candidates:
                raise NoWorkers("no healthy decode or collocated worker")
            slot.move(self.policy.choose(candidates, hashes))
        worker = slot.worker
        worker.prefix.add(hashes)
        leg = LegRequest(request_id, tuple(prompt), params)
        sent = 0
        try:
            async for batch in self._leg(worker, leg):
                sent = max(sent, _end(batch))
                yield batch
        except LegFailed as e:
            if e.client_error or sent > 0 or len(tried) >= 1:
                raise
            self.pool.mark_failed(worker, str(e))
            self.metrics.retries.inc(reason="local leg failed")
            log.warning("request %s: %s; retrying on another worker", request_id, e)
            async for batch in self._local(request_id, prompt, params, hashes, slot,
                                           (*tried, worker)):
                yield batch

    # -- disaggregated -----------------------------------------------------------------------

    async def _disaggregated(self, request_id: str, prompt: Sequence[int],
                             params: SamplingParams, hashes: list[int], pre_slot: Slot,
                             slot: Slot) -> AsyncIterator[EventBatch]:
        pre, dec = pre_slot.worker, slot.worker
        tid = secrets.randbits(64) or 1
        pre.prefix.add(hashes)
        dec.prefix.add(hashes)
        ids = tuple(prompt)
        legs = {
            "prefill": (pre, LegRequest(request_id, ids, params, LegKind.PREFILL, tid, dec.peer)),
            "decode": (dec, LegRequest(request_id, ids, params, LegKind.DECODE, tid, pre.peer)),
        }
        merged: asyncio.Queue = asyncio.Queue()
        slots = {"prefill": pre_slot, "decode": None}
        tasks = {name: asyncio.create_task(self._pump(name, w, leg, merged, slots[name]))
                 for name, (w, leg) in legs.items()}
        sent, ended, heard = 0, set(), set()
        try:
            while len(ended) < len(tasks):
                name, item = await merged.get()
                if item is None:
                    ended.add(name)
                    continue
                heard.add(name)
                if name == "decode" and "prefill" not in heard and _recomputed(item):
                    self._prefill_silent(request_id, pre)
                if isinstance(item, LegFailed) and name == "prefill":
                    if item.client_error:
                        raise item
                    log.warning("request %s: %s; decode recomputes", request_id, item)
                    self.metrics.retries.inc(reason="prefill leg failed")
                    continue
                batch, failure = (([], item) if isinstance(item, LegFailed)
                                  else _relayed(name, item))
                if batch:
                    sent = max(sent, _end(batch))
                    yield batch
                    if batch[-1].final:
                        return
                if failure is not None:
                    if failure.client_error or sent > 0:
                        raise failure
                    self.pool.mark_failed(dec, str(failure))
                    self.metrics.retries.inc(reason="decode leg failed")
                    log.warning("request %s: %s; retrying as a local leg", request_id, failure)
                    tasks["prefill"].cancel()
                    async for retried in self._local(request_id, prompt, params, hashes,
                                                     slot, tried=(dec,)):
                        yield retried
                    return
            raise LegFailed("both legs ended without finishing the request")
        finally:
            for task in tasks.values():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks.values(), return_exceptions=True)
            pre_slot.release()  # no-op when its leg ended (the pump released it)

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
        """Relays one leg; its own slot (the prefill's) frees when the leg ends."""
        completed: int | None = None
        try:
            async for batch in self._leg(worker, leg):
                merged.put_nowait((name, batch))
                if batch[-1].final:
                    completed = 0  # a prefill holds the prompt's KV only
        except LegFailed as e:
            merged.put_nowait((name, e))
        finally:
            if slot is not None:
                slot.release(completed)
        merged.put_nowait((name, None))

    def _leg(self, worker: WorkerHandle, leg: LegRequest) -> AsyncIterator[EventBatch]:
        return self.channels.stream(worker, leg, self.settings.leg_timeout_s)


def _recomputed(item: EventBatch | LegFailed) -> bool:
    return not isinstance(item, LegFailed) and any(e.extra.get("recomputed") for e in item)


def _end(batch: EventBatch) -> int:
    """The output position after the batch's last token."""
    return batch[-1].index + len(batch[-1].token_ids)


def _relayed(leg: str, batch: EventBatch) -> tuple[EventBatch, LegFailed | None]:
    """What of a disaggregated request's batch from `leg` goes to the client, up to the final
    event; and the decode leg's failure, if one of its events reports it (what came before it
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
            return out, LegFailed(event.error)
        out.append(event)
        if event.final:
            break
    return out, None
