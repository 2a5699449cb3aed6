"""Workers' legs played by a deterministic fake model, for the dispatcher's fallback chain: a
token is a function of the whole context, the seed and its output position (as a seeded
sampler's draw is), so a continuation that gets the right prompt and `output_offset` yields
exactly the tokens the first worker would have. Each worker's behaviour is scripted by URL:
lose the leg after some tokens, hand it back (as a worker changing role does), refuse it, hold
text back, sample otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from pdserve.legs.protocol import MOVED, EventBatch, LegKind, LegRequest, TokenEvent
from pdserve.router.leg_client import LegFailed
from pdserve.router.worker_pool import WorkerHandle


def next_token(context: Sequence[int], seed: int | None, position: int) -> int:
    return (sum(context) * 7 + len(context) * 3 + (seed or 0) * 11 + position * 5) % 89 + 10


def text_of(token: int) -> str:
    return f"<{token}>"


def reference(prompt: Sequence[int], max_tokens: int, seed: int | None = None) -> list[int]:
    """The undisturbed output."""
    ctx, out = list(prompt), []
    for p in range(max_tokens):
        out.append(next_token(ctx, seed, p))
        ctx.append(out[-1])
    return out


@dataclass
class Opened:
    url: str
    leg: LegRequest


@dataclass
class ScriptedModel:
    lose_after: dict[str, int] = field(default_factory=dict)  # URL -> tokens, then lost
    # URL -> tokens, then handed back (once per URL: a worker changes role once)
    hand_back_after: dict[str, int] = field(default_factory=dict)
    refuse: dict[str, int] = field(default_factory=dict)  # URL -> status it refuses with
    lost_at_connect: set[str] = field(default_factory=set)  # any leg there fails at once
    hold_back: dict[str, set[int]] = field(default_factory=dict)  # URL -> positions held
    skew: dict[str, int] = field(default_factory=dict)  # URL -> added to every token
    opened: list[Opened] = field(default_factory=list)
    closed_early: list[str] = field(default_factory=list)  # leg ids closed before their end
    _kv: dict[int, asyncio.Event] = field(default_factory=dict)  # transfer id -> token 0 out

    def legs(self, url: str) -> list[LegRequest]:
        return [o.leg for o in self.opened if o.url == url]

    def kinds(self) -> list[tuple[str, LegKind, str]]:
        return [(o.url, o.leg.kind, o.leg.request_id) for o in self.opened]

    async def stream(self, worker: WorkerHandle, leg: LegRequest, idle_s: float
                     ) -> AsyncIterator[EventBatch]:
        self.opened.append(Opened(worker.url, leg))
        if worker.url in self.refuse:
            raise LegFailed("refused: the prompt is too long", self.refuse[worker.url])
        if worker.url in self.lost_at_connect:
            raise LegFailed(f"{leg.kind.value} leg on {worker.url} failed: connection refused")
        finished = False
        try:
            if leg.kind is LegKind.PREFILL:
                token = self._token(worker.url, leg, list(leg.prompt_token_ids), 0)
                self._kv.setdefault(leg.transfer_id, asyncio.Event()).set()
                finished = True
                yield [TokenEvent(0, [token], 0, text_of(token), final=True,
                                  prompt_tokens=len(leg.prompt_token_ids))]
                return
            if leg.kind is LegKind.DECODE:  # waits for the KV, as a reservation does
                await self._kv.setdefault(leg.transfer_id, asyncio.Event()).wait()
            async for batch in self._generate(worker.url, leg):
                finished = batch[-1].final
                yield batch
        finally:
            if not finished:
                self.closed_early.append(leg.request_id)

    async def _generate(self, url: str, leg: LegRequest) -> AsyncIterator[EventBatch]:
        ctx, text, pending = list(leg.prompt_token_ids), "", ""
        held = self.hold_back.get(url, set())
        for k in range(leg.params.max_tokens):
            if k == self.lose_after.get(url, -1):
                raise LegFailed(f"{url} closed the {leg.kind.value} leg before its end")
            if k == self.hand_back_after.get(url, -1):
                del self.hand_back_after[url]
                yield [TokenEvent(k, [], len(text), "", final=True, extra={MOVED: True})]
                return
            token = self._token(url, leg, ctx, k)
            ctx.append(token)
            pending += text_of(token)
            out = "" if leg.output_offset + k in held else pending
            last = k == leg.params.max_tokens - 1
            event = TokenEvent(k, [token], len(text), out, prompt_tokens=len(leg.prompt_token_ids),
                               finish_reason="length" if last else None, final=last)
            text, pending = text + out, pending[len(out):]
            await asyncio.sleep(0)
            yield [event]

    def _token(self, url: str, leg: LegRequest, ctx: list[int], k: int) -> int:
        return next_token(ctx, leg.params.seed, leg.output_offset + k) + self.skew.get(url, 0)
