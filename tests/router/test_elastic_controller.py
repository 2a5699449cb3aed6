"""The elastic controller in a real router over fake workers that keep the `/internal/role`
contract: under sustained prefill pressure it flips the least loaded decode worker to prefill
(once: the cool-down), through the same path and metrics as an operator's flip; without
`--elastic` nothing flips."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from pdserve.router.app import Router
from pdserve.router.elastic_settings import ElasticSettings
from tests.router.fake_worker import worker_info
from tests.router.test_registry_admin import FlippingWorker, router, workers

RATES = {"prefill_tokens_per_s": 1000.0, "decode_step_s": 0.005}
FAST = ElasticSettings(ttft_target_s=1.0, tpot_target_s=0.1, interval_s=0.05, sustain_ticks=3,
                       cooldown_s=600.0)


def _fakes() -> list[FlippingWorker]:
    return [FlippingWorker(worker_info("prefill", rates=RATES)),
            FlippingWorker(worker_info("decode", rates=RATES)),
            FlippingWorker(worker_info("decode", rates=RATES))]


def _run(tiny_model: Callable[..., Path], fakes: list[FlippingWorker],
         elastic: ElasticSettings | None, body) -> None:
    async def go() -> None:
        async with workers(*fakes) as urls:
            pools = {"prefill": (urls[0],), "decode": tuple(urls[1:])}
            async with router(tiny_model(), elastic=elastic, **pools) as (r, _):
                await body(r)

    asyncio.run(go())


async def _press_prefill(r: Router) -> None:
    """5000 prompt tokens sent to the prefill worker and not prefilled: a 5 s wait at 1000
    tokens/s; the first decode worker has a leg open, the second none."""
    prefill, busy, _ = r.pool.workers
    r.dispatcher.paths.prefilling(prefill, 5000)
    busy.inflight = 1


def test_sustained_prefill_pressure_flips_the_idle_decode_worker(
        tiny_model: Callable[..., Path]) -> None:
    fakes = _fakes()

    async def body(r: Router) -> None:
        await _press_prefill(r)
        for _ in range(200):
            if r.pool.workers[2].role == "prefill":
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # more ticks: the cool-down holds
        assert [w.role for w in r.pool.workers] == ["prefill", "decode", "prefill"]
        assert all(w.routable for w in r.pool.workers)
        r.metrics.refresh()
        text = r.metrics.registry.render()
        key = r.pool.workers[2].key
        for line in ('pdserve_role_flips_total{from="decode",to="prefill"} 1',
                     f'pdserve_worker_role{{worker="{key}",role="prefill"}} 1',
                     f'pdserve_worker_role{{worker="{key}",role="decode"}} 0'):
            assert line in text, line

    _run(tiny_model, fakes, FAST, body)
    assert [f.flips for f in fakes] == [0, 0, 1]
    assert [f.info["role"] for f in fakes] == ["prefill", "decode", "prefill"]


def test_a_refused_flip_is_logged_and_cooled_down(tiny_model: Callable[..., Path],
                                                  caplog) -> None:
    fakes = _fakes()
    fakes[2].answer = 503

    async def body(r: Router) -> None:
        await _press_prefill(r)
        for _ in range(200):
            if fakes[2].flips:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        assert [w.role for w in r.pool.workers] == ["prefill", "decode", "decode"]

    with caplog.at_level("INFO", logger="pdserve.router"):
        _run(tiny_model, fakes, FAST, body)
    assert [f.flips for f in fakes] == [0, 0, 1]  # asked once, not again within the cool-down
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("elastic: flipping worker") and
               "decode -> prefill: prefill wait ~5000 ms" in m for m in messages), messages
    assert any(m.startswith("elastic: flipping worker") and "not done (503)" in m
               for m in messages)


def test_a_pressure_no_flip_may_relieve_is_said_once_with_its_reason(
        tiny_model: Callable[..., Path], caplog) -> None:
    """Prefill pressure with one decode worker, the last one that can decode: for the ~20
    ticks the body lasts nothing flips, and the log says why once (HOLD_LOG_S)."""
    fakes = _fakes()[:2]

    async def body(r: Router) -> None:
        prefill, decode = r.pool.workers
        r.dispatcher.paths.prefilling(prefill, 5000)
        decode.inflight = 1
        await asyncio.sleep(1.0)
        assert [w.role for w in r.pool.workers] == ["prefill", "decode"]

    with caplog.at_level("INFO", logger="pdserve.router"):
        _run(tiny_model, fakes, FAST, body)
    assert [f.flips for f in fakes] == [0, 0]
    held = [r.getMessage() for r in caplog.records if "no flip" in r.getMessage()]
    assert len(held) == 1, held
    assert held[0].startswith("elastic: prefill pressure for 3 ticks, no flip: ")
    assert " is the last decode-capable worker; no loan: " in held[0]
    assert held[0].endswith(" reports no host and cores")  # fakes say neither: no loan


def test_without_elastic_nothing_flips(tiny_model: Callable[..., Path]) -> None:
    fakes = _fakes()

    async def body(r: Router) -> None:
        assert r.elastic is None
        await _press_prefill(r)
        await asyncio.sleep(0.5)

    _run(tiny_model, fakes, None, body)
    assert [f.flips for f in fakes] == [0, 0, 0]



def test_an_idle_prefill_worker_becomes_decode_once_the_arrivals_let_the_decoders_take_it(
        tiny_model: Callable[..., Path]) -> None:
    """The prefill worker gets nothing and the decode worker streams, but prompts arrive at
    the decode worker at ~10,000 tokens/s, 10x what it prefills: the prefill worker stays.
    Once they stop and the controller's window no longer holds them, it becomes decode."""
    fakes = _fakes()[:2]

    async def body(r: Router) -> None:
        prefill, decode = r.pool.workers
        decode.inflight = 4

        async def arrive() -> None:
            while True:
                r.dispatcher.paths.prefilling(decode, 100)()
                await asyncio.sleep(0.01)

        arrivals = asyncio.create_task(arrive())
        await asyncio.sleep(1.0)  # 20 ticks, each with the idle trigger on
        assert prefill.role == "prefill" and fakes[0].flips == 0
        assert r.elastic.memory.idle_ticks >= FAST.sustain_ticks
        arrivals.cancel()
        for _ in range(200):
            if prefill.role == "decode":
                break
            await asyncio.sleep(0.05)
        assert [w.role for w in r.pool.workers] == ["decode", "decode"]

    _run(tiny_model, fakes, FAST, body)
    assert [f.flips for f in fakes] == [1, 0]
