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
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from pdserve.common.block_hash import hash_blocks
from pdserve.common.sampling_params import SamplingParams
from pdserve.legs.protocol import EventBatch, LegKind, LegRequest
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
                 channels: RouterLegChannels, metrics: RouterMetrics) -> None:
        self.pool, self.policy, self.settings = pool, policy, settings
        self.channels, self.metrics = channels, metrics

    async def generate(self, request_id: str, prompt: Sequence[int], params: SamplingParams
                       ) -> AsyncIterator[EventBatch]:
        """Token events of one request from any legs, in batches; the last event is final.
        Raises LegFailed (its `client_error` says whose fault) or NoWorkers."""
        if params.seed is None and not params.greedy:
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        block_size = self.pool.block_size or self.settings.block_size
        hashes = hash_blocks(prompt, block_size)
        prefill, decode = self.pool.healthy("prefill"), self.pool.healthy("decode")
        if prefill and decode:
            dec = self.policy.choose(decode, hashes)
            uncached = len(prompt) - dec.prefix.match(hashes) * block_size
            if uncached > self.settings.local_prefill_threshold:
                pre = self.policy.choose(prefill, hashes)
                self.metrics.requests.inc(path="disaggregated")
                async for batch in self._disaggregated(request_id, prompt, params, hashes,
                                                       pre, dec):
                    yield batch
                return
        self.metrics.requests.inc(path="local")
        async for batch in self._local(request_id, prompt, params, hashes, tried=()):
            yield batch

    # -- local -------------------------------------------------------------------------------

    def _local_candidates(self, tried: Sequence[WorkerHandle]) -> list[WorkerHandle]:
        pool = self.pool.healthy("collocated") + self.pool.healthy("decode")
        return [w for w in pool if w not in tried]

    async def _local(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                     hashes: list[int], tried: Sequence[WorkerHandle], delivered: int = 0
                     ) -> AsyncIterator[EventBatch]:
        candidates = self._local_candidates(tried)
        if not candidates:
            raise NoWorkers("no healthy decode or collocated worker")
        worker = self.policy.choose(candidates, hashes)
        worker.prefix.add(hashes)
        leg = LegRequest(request_id, tuple(prompt), params)
        sent = delivered
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
            async for batch in self._local(request_id, prompt, params, hashes,
                                           (*tried, worker)):
                yield batch

    # -- disaggregated -----------------------------------------------------------------------

    async def _disaggregated(self, request_id: str, prompt: Sequence[int],
                             params: SamplingParams, hashes: list[int], pre: WorkerHandle,
                             dec: WorkerHandle) -> AsyncIterator[EventBatch]:
        tid = secrets.randbits(64) or 1
        pre.prefix.add(hashes)
        dec.prefix.add(hashes)
        ids = tuple(prompt)
        legs = {
            "prefill": (pre, LegRequest(request_id, ids, params, LegKind.PREFILL, tid, dec.peer)),
            "decode": (dec, LegRequest(request_id, ids, params, LegKind.DECODE, tid, pre.peer)),
        }
        merged: asyncio.Queue = asyncio.Queue()
        tasks = {name: asyncio.create_task(self._pump(name, w, leg, merged))
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
                                                     tried=(dec,)):
                        yield retried
                    return
            raise LegFailed("both legs ended without finishing the request")
        finally:
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
                    merged: asyncio.Queue) -> None:
        try:
            async for batch in self._leg(worker, leg):
                merged.put_nowait((name, batch))
        except LegFailed as e:
            merged.put_nowait((name, e))
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
