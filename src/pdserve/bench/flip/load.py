"""The requests of `pdserve bench flip`: a fixed set of prompts, each sent once for its reference
output, then again and again by the streaming clients while a worker flips.

Prompt p is `t.prompt_cap` token ids (every prompt is that long) that depend only on
(`t.seed`, p), in `chaos.load.request`'s completion body (greedy, ignore_eos, streamed), so
every send of p is the same request and its greedy text must equal the reference's. A
request's text is the concatenation of its token events' text; its outcome is
`chaos.stream.classify`'s (one that gets no byte for `t.idle_s` is cut off: hung). A client
whose request did not end ok waits BACKOFF_S before its next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

from pdserve.bench.chaos.load import BACKOFF_S, LoadTarget, RequestShape, request, send
from pdserve.bench.chaos.stream import Outcome, SseReader, classify


@dataclass
class TextReader(SseReader):
    """An `SseReader` that also keeps the text of every token event, in order, and the
    response's id (the router's request id, which its log lines name)."""

    pieces: list[str] = field(default_factory=list)
    response_id: str = ""

    def feed(self, line: bytes, now_s: float) -> None:
        tokens = len(self.token_times_s)
        super().feed(line, now_s)
        if len(self.token_times_s) > tokens:  # a token event: its JSON parsed already once
            event = json.loads(line.strip()[5:])
            self.pieces.append(event["choices"][0]["text"])
            self.response_id = self.response_id or str(event.get("id", ""))


@dataclass(frozen=True)
class Served:
    """One request: its prompt, times in seconds since the load's start, outcome, text and
    response id ("" before a token came)."""

    prompt: int
    start_s: float
    end_s: float
    outcome: Outcome
    detail: str
    text: str
    response_id: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


async def serve(session: aiohttp.ClientSession, t: LoadTarget, prompt: int, t0: float
                ) -> Served:
    """Send prompt `prompt` once, streamed, and read it to its end."""
    shape = RequestShape("short", t.prompt_cap, t.max_tokens)
    url, body = request(t, shape, random.Random(f"pdserve-flip/{t.seed}/{prompt}"))
    reader, start = TextReader(), time.perf_counter() - t0
    ended = await send(session, url, body, t.idle_s, t0, reader)
    outcome, why = classify(ended.status, reader, ended.end, ended.detail)
    return Served(prompt, start, time.perf_counter() - t0, outcome, why, "".join(reader.pieces),
                  reader.response_id)


async def references(session: aiohttp.ClientSession, t: LoadTarget, prompts: int,
                     streams: int) -> list[Served]:
    """Every prompt once, at most `streams` at a time, in prompt order."""
    gate, t0 = asyncio.Semaphore(streams), time.perf_counter()

    async def one(p: int) -> Served:
        async with gate:
            return await serve(session, t, p, t0)

    return list(await asyncio.gather(*(one(p) for p in range(prompts))))


async def client(session: aiohttp.ClientSession, t: LoadTarget, index: int, streams: int,
                 prompts: int, stop: asyncio.Event, t0: float, out: list[Served]) -> None:
    """Client `index` of `streams`: prompts index, index + streams, ... (modulo `prompts`) one
    after another until `stop` is set; the one in flight then ends on its own. Cancelled
    mid-request, it records that request as hung."""
    j = 0
    while not stop.is_set():
        prompt, start = (index + j * streams) % prompts, time.perf_counter() - t0
        try:
            served = await serve(session, t, prompt, t0)
        except asyncio.CancelledError:
            out.append(Served(prompt, start, time.perf_counter() - t0, Outcome.HUNG,
                              "still running when the load was cut off", ""))
            raise
        out.append(served)
        j += 1
        if not served.ok:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), BACKOFF_S)
