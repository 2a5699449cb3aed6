"""The inputs the dispatcher gives the split decision for a prompt whose prefix one worker
holds: each prefill worker is counted with the tokens it lacks (not the decode worker's), every
link with the KV of the whole prompt (what a split moves), and a hand-over teaches its link
those same bytes. The debug log names the inputs."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pdserve.common.block_hash import hash_blocks
from pdserve.internal_auth import InternalAuth
from pdserve.legs.protocol import LegKind
from pdserve.router.admission_settings import AdmissionSettings
from pdserve.router.dispatch import Dispatcher, DispatchSettings
from pdserve.router.policies import LeastLoaded
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.worker_pool import WorkerHandle, WorkerPool
from pdserve.transfer.peer import PeerId
from tests.router.fake_worker import NAME, SECRET, worker_info
from tests.router.test_link_choice import PARAMS, LinkedLegs

BLOCK = 16  # worker_info's block size
KV_BYTES = 512  # worker_info's KV bytes per token
PROMPT = list(range(392))  # 24 full blocks and 8 tokens: 400 tokens' KV moves on a split
HELD = 8  # tokens a worker holding the prompt's blocks still computes


def dispatcher(legs: LinkedLegs, prefill_tps: float, decode_tps: float) -> Dispatcher:
    pool = WorkerPool({"prefill": ["http://p0"], "decode": ["http://d"]}, InternalAuth(SECRET),
                      NAME)
    pool.reference = {"kv_layout": worker_info()["kv_layout"]}
    rates = {"prefill": prefill_tps, "decode": decode_tps}
    for port, w in enumerate(pool.workers, 9001):
        w.healthy, w.peer = True, PeerId(port, "127.0.0.1", port)
        w.info = worker_info(w.role, rates={"prefill_tokens_per_s": rates[w.role]})
    return Dispatcher(pool, LeastLoaded(), DispatchSettings(), legs, RouterMetrics(),
                      AdmissionSettings(max_inflight_per_worker=4, max_queue=4))


def holds_the_prompt(worker: WorkerHandle) -> None:
    """The router sent `worker` this prompt before: its index holds the prompt's blocks."""
    worker.prefix.add(hash_blocks(PROMPT, BLOCK))


async def run(d: Dispatcher) -> None:
    async for _ in d.generate("cmpl-1", PROMPT, PARAMS):
        pass


def test_a_prefill_worker_is_counted_with_the_tokens_it_lacks(
        caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        legs = LinkedLegs({"http://p0": 0.0})
        d = dispatcher(legs, prefill_tps=1000.0, decode_tps=100.0)
        _, dec = d.pool.workers
        holds_the_prompt(dec)  # 8 tokens locally: 80 ms; p0 computes all 392: 392 ms
        with caplog.at_level(logging.DEBUG, logger="pdserve.router"):
            await run(d)
        # counted with the decode worker's 8 tokens, p0 looked 8 ms away and got the prompt
        assert legs.opened == [("http://d", LegKind.LOCAL)]
        assert "U_d 8 + Q_d 0 tokens at R_d 100/s" in caplog.text
        assert "U_p 392 + Q_p 0 tokens at R_p 1000/s" in caplog.text
        assert "N 400 tokens' KV" in caplog.text

    asyncio.run(go())


def test_the_link_is_counted_with_the_whole_prompt_s_kv() -> None:
    async def go() -> None:
        legs = LinkedLegs({"http://p0": 0.0})
        d = dispatcher(legs, prefill_tps=1000.0, decode_tps=100.0)
        p0, dec = d.pool.workers
        holds_the_prompt(dec)
        holds_the_prompt(p0)  # 8 tokens either side: 80 ms locally, 8 ms on p0
        d.paths.handed_over(p0, dec, 2048, 1.0)  # 1 MiB in 1 s
        await run(d)
        # 400 tokens' KV (200 kB) take 195 ms on that link, not 8 tokens' 4 ms
        assert legs.opened == [("http://d", LegKind.LOCAL)]

    asyncio.run(go())


def test_a_hand_over_teaches_its_link_the_bytes_that_moved() -> None:
    async def go() -> None:
        legs = LinkedLegs({"http://p0": 0.0})
        d = dispatcher(legs, prefill_tps=1000.0, decode_tps=1.0)  # a slow decode worker
        _, dec = d.pool.workers
        holds_the_prompt(dec)
        seen: list[int] = []
        observe = d.paths.links.observe

        def spy(prefill: str, decode: str, nbytes: int, seconds: float) -> None:
            seen.append(nbytes)
            observe(prefill, decode, nbytes, seconds)

        d.paths.links.observe = spy  # type: ignore[method-assign]
        await run(d)
        assert ("http://p0", LegKind.PREFILL) in legs.opened
        assert seen == [400 * KV_BYTES]  # the whole prompt's blocks, not the 8 tokens d lacked

    asyncio.run(go())
