"""The load of `pdserve bench chaos`: `streams` closed-loop clients, each sending one streamed
request after another until told to stop.

The mix (`draw`): request j of client c depends only on (seed, c, j). Shares: MIX, each with
its prompt range in tokens, capped at `prompt_cap` (the context minus the largest output):
short chat messages (text, /v1/chat/completions), short completions (run whole on a decode
worker under the default --local-prefill-threshold of 256), medium and long completions (split
into a prefill and a decode leg). Completion prompts are token ids, so the server sees exactly
that many; every request asks for 8..max_tokens tokens with ignore_eos, greedy.

A request never waits longer than `idle_s` for its next byte (response headers included): past
it the client closes the connection and the request is hung. After any request that did not
end ok, its client waits before the next one, as a well-behaved client backs off: the
refusal's Retry-After (at most MAX_BACKOFF_S), else BACKOFF_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve.bench.chaos.stream import End, Outcome, SseReader, classify, clip, http_error
from pdserve.bench.serve.workloads import token_id_range

BACKOFF_S = 1.0
MAX_BACKOFF_S = 10.0
MIN_TOKENS = 8
LONG_TOKENS = 1500  # the longest prompt: about 1.5 s of prefill for SmolLM2 on one core
# (name, share, prompt tokens lo, hi): chat prompts are words of text, the rest token ids
MIX = (("chat", 0.2, 16, 64), ("short", 0.35, 32, 200), ("medium", 0.25, 300, 600),
       ("long", 0.2, 800, LONG_TOKENS))
WORDS = ("alpha", "river", "stone", "music", "paper", "light", "green", "table", "cloud")


@dataclass(frozen=True)
class RequestShape:
    name: str  # a MIX name
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class RequestResult:
    """What one request came to; times in seconds since the load started."""

    shape: str
    prompt_tokens: int
    start_s: float
    first_token_s: float | None
    end_s: float
    tokens: int
    outcome: Outcome
    detail: str
    retry_after_s: float | None = None  # the Retry-After of an HTTP error, if any

    @property
    def backoff_s(self) -> float:
        """How long its client waits before its next request."""
        if self.outcome is Outcome.OK:
            return 0.0
        if self.retry_after_s is None:
            return BACKOFF_S
        return min(self.retry_after_s, MAX_BACKOFF_S)


@dataclass(frozen=True)
class Ended:
    """How a request's exchange ended: the status (None: no response headers), how the
    client stopped reading, the HTTP error text or connection error, the Retry-After."""

    status: int | None
    end: End
    detail: str = ""
    retry_after_s: float | None = None


def retry_after(value: str | None) -> float | None:
    """Seconds of a Retry-After header given in seconds; None for none or an HTTP date."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


@dataclass(frozen=True)
class LoadTarget:
    """Where and what the clients send: the router's /v1 base URL, the served model name, its
    vocabulary (prompt ids are drawn below it) and the longest prompt that fits."""

    url: str
    model: str
    vocab: int
    prompt_cap: int
    max_tokens: int
    idle_s: float
    seed: int = 0


def draw(seed: int, client: int, index: int, prompt_cap: int, max_tokens: int) -> RequestShape:
    rng = random.Random(f"pdserve-chaos/{seed}/{client}/{index}")
    pick, acc = rng.random(), 0.0
    for name, share, lo, hi in MIX:
        acc += share
        if pick < acc or name == MIX[-1][0]:
            hi = max(1, min(hi, prompt_cap))
            tokens = rng.randint(min(lo, hi), hi)
            return RequestShape(name, tokens, rng.randint(min(MIN_TOKENS, max_tokens),
                                                          max_tokens))
    raise AssertionError("MIX is not empty")


def request(t: LoadTarget, shape: RequestShape, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """(URL, JSON body) of a streamed request of `shape`."""
    common = {"model": t.model, "max_tokens": shape.max_tokens, "temperature": 0,
              "ignore_eos": True, "stream": True}
    base = t.url.rstrip("/")
    if shape.name == "chat":
        text = " ".join(rng.choice(WORDS) for _ in range(shape.prompt_tokens))
        return base + "/chat/completions", common | {
            "messages": [{"role": "user", "content": text}]}
    lo, hi = token_id_range(t.vocab)
    return base + "/completions", common | {
        "prompt": [rng.randrange(lo, hi) for _ in range(shape.prompt_tokens)]}


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any], idle_s: float,
               t0: float, reader: SseReader) -> Ended:
    """POST `body` and read its stream into `reader` until it finishes or `idle_s` passes
    without a byte."""
    status, loop = None, asyncio.get_running_loop()
    try:
        async with asyncio.timeout(idle_s) as bound:
            async with session.post(url, json=body) as resp:
                status = resp.status
                if status != 200:
                    text = await resp.text(errors="replace")
                    return Ended(status, End.EOF, http_error(status, text),
                                 retry_after(resp.headers.get("Retry-After")))
                async for line in resp.content:
                    bound.reschedule(loop.time() + idle_s)
                    reader.feed(line, time.perf_counter() - t0)
                    if reader.finished:
                        break
    except TimeoutError:
        return Ended(status, End.IDLE, f"{idle_s:g} s")
    except (aiohttp.ClientError, OSError) as e:
        return Ended(status, End.CONNECTION, clip(f"{type(e).__name__}: {e}"))
    return Ended(status, End.EOF)


async def one(session: aiohttp.ClientSession, t: LoadTarget, shape: RequestShape,
              rng: random.Random, t0: float) -> RequestResult:
    url, body = request(t, shape, rng)
    reader, start = SseReader(), time.perf_counter() - t0
    ended = await send(session, url, body, t.idle_s, t0, reader)
    outcome, why = classify(ended.status, reader, ended.end, ended.detail)
    times = reader.token_times_s
    return RequestResult(shape.name, shape.prompt_tokens, start, times[0] if times else None,
                         time.perf_counter() - t0, len(times), outcome, why,
                         ended.retry_after_s)


async def client(session: aiohttp.ClientSession, t: LoadTarget, index: int,
                 stop: asyncio.Event, t0: float, out: list[RequestResult]) -> None:
    """Client `index`: requests one after another until `stop` is set (the one in flight
    then ends on its own, within its idle bound). Cancelled mid-request, it records that
    request as hung."""
    j = 0
    while not stop.is_set():
        shape = draw(t.seed, index, j, t.prompt_cap, t.max_tokens)
        start = time.perf_counter() - t0
        try:
            result = await one(session, t, shape, random.Random(f"{t.seed}/{index}/{j}/ids"),
                               t0)
        except asyncio.CancelledError:
            now = time.perf_counter() - t0
            out.append(RequestResult(shape.name, shape.prompt_tokens, start, None, now, 0,
                                     Outcome.HUNG, "still running when the load was cut off"))
            raise
        out.append(result)
        j += 1
        if result.backoff_s:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), result.backoff_s)
