"""The front end's round trip on an idle server, measured after each `bench compare` run.

`pdserve simulate` prices the engine steps from a run's step trace; what a request spends
outside them (client to router to worker and its token back, HTTP both ways) is one round trip
it adds to every TTFT (planner/simulate/frontend_fit.py). A busy run cannot show it apart from
queueing; an idle server can: once the run is over (before it, the probes' short prompt steps
would enter the rates the router splits prompts by), `PROBES` requests of `PROBE_TOKENS`
prompt tokens and one output token go one after the other through `bench serve`'s own
streaming client, and each TTFT is kept. The simulator takes the fastest, less what it prices
the same request at on the same idle layout.

Each probe's prompt is its own (token ids from a fixed seed, none shared with a workload's), so
none is a prefix-cache hit of another and none warms the trace's.

Results key (bench compare, per configuration): "frontend_probe": {"prompt_tokens": n,
"ttft_s": [...], "step_s": [...]} (failed probes left out; `step_s` the seconds of each
probe's own prompt step in the workers' traces, in the probes' order, `compare.probe_steps`).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp

from pdserve.bench.serve.client import completions_url, send_request
from pdserve.bench.serve.workloads import RequestSpec

PROBES = 5
PROBE_TOKENS = 32
PROBE_TIMEOUT_S = 60.0
SEED = 7919  # any fixed seed: the prompts are the same in every run
VOCAB = (100, 500)  # token ids inside any model's vocabulary (a tiny test model's has 512)


def probe_requests() -> list[RequestSpec]:
    rng = random.Random(SEED)
    return [RequestSpec(0.0, tuple(rng.randrange(*VOCAB) for _ in range(PROBE_TOKENS)), 1)
            for _ in range(PROBES)]


async def probe_async(url: str, model: str) -> list[float]:
    """Each probe's TTFT in seconds, failed ones left out."""
    ttfts = []
    async with aiohttp.ClientSession() as session:
        for spec in probe_requests():
            record = await send_request(session, completions_url(url), model, spec,
                                        PROBE_TIMEOUT_S)
            if record.ok and record.token_times_s:
                ttfts.append(record.token_times_s[0] - record.send_s)
    return ttfts


def probe_frontend(url: str, model: str) -> dict[str, Any]:
    """The results entry above, measured now against `url` (idle)."""
    return {"prompt_tokens": PROBE_TOKENS, "ttft_s": asyncio.run(probe_async(url, model))}
