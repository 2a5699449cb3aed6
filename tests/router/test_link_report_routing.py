"""The router routes by the prefill workers' own link reports, read from their signed /health,
where it has no hand-over of its own on a link: a prefill worker that reports a slow link to
the decode worker gets no split prompt while another reports a fast one, and a prompt stays
local when the only link is reported too slow. Only a prefill worker's link to a decode
worker counts (not the decode worker's own link back), and a link no longer reported is gone.
The debug log names the link's source, and `pdserve_router_split_link_source_total` counts
it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.internal_auth import InternalAuth
from pdserve.legs.protocol import LegKind
from pdserve.router.admission_settings import AdmissionSettings
from pdserve.router.app import Router, RouterSettings
from pdserve.router.dispatch import Dispatcher, DispatchSettings
from pdserve.router.path_choice import Prompt
from pdserve.router.policies import LeastLoaded
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.worker_pool import Answer, WorkerPool
from pdserve.transfer.peer import PeerId
from tests.router.fake_worker import NAME, SECRET, FakeWorker, fake_workers, worker_info
from tests.router.test_link_choice import PARAMS, PROMPT, LinkedLegs

DECODE_KV = ("127.0.0.1", 7000)  # the decode worker's KV endpoint, as its /health names it


def link(gbps: float, app_limited: bool = False, nbytes: int = 4_000_000) -> dict[str, Any]:
    """A prefill worker's tcp report of its connection to the decode worker."""
    return {"peer": f"{DECODE_KV[0]}:{DECODE_KV[1]}", "source": "tcp_info", "gbps": gbps,
            "bytes_sent": nbytes, "rtt_ms": 1.0, "min_rtt_ms": 0.5,
            "app_limited": app_limited}


def info(role: str, port: int, prefill_tps: float, links: list[dict[str, Any]]
         ) -> dict[str, Any]:
    peer = PeerId(port, "127.0.0.1", port).to_json()
    return worker_info(role, peer=peer, links=links,
                       rates={"prefill_tokens_per_s": prefill_tps})


def test_a_prompt_splits_through_the_prefill_worker_that_reports_the_faster_link(
        caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        pool = WorkerPool({"prefill": ["http://p0", "http://p1"], "decode": ["http://d"]},
                          InternalAuth(SECRET), NAME)
        health = {"http://p0": info("prefill", 9001, 1000.0, [link(0.001)]),  # 125 kB/s
                  "http://p1": info("prefill", 9002, 1000.0, [link(10.0)]),
                  "http://d": info("decode", DECODE_KV[1], 100.0, [])}
        legs = LinkedLegs({"http://p0": 0.0, "http://p1": 0.0})
        d = Dispatcher(pool, LeastLoaded(), DispatchSettings(), legs, RouterMetrics(),
                       AdmissionSettings(max_inflight_per_worker=4, max_queue=4))
        for w in pool.workers:
            pool.judge(w, Answer(info=health[w.url]))  # as a health round does
        with caplog.at_level(logging.DEBUG, logger="pdserve.router"):
            async for _ in d.generate("cmpl-1", PROMPT, PARAMS):
                pass
        # without the reports both links counted at no cost and the policy picked p0
        assert legs.opened[:2] == [("http://p1", LegKind.PREFILL), ("http://d", LegKind.DECODE)]
        assert "link p1 -> d [report] 10000.0 Mb/s + 1.0 ms (worker report)" in caplog.text
        assert d.metrics.split_link_source.value(source="report") == 1

    asyncio.run(go())


def test_only_a_prefill_worker_s_report_of_its_link_to_a_decode_worker_counts() -> None:
    pool = WorkerPool({"prefill": ["http://p0"], "decode": ["http://d"]}, InternalAuth(SECRET),
                      NAME)
    d = Dispatcher(pool, LeastLoaded(), DispatchSettings(), LinkedLegs({}), RouterMetrics(),
                   AdmissionSettings(max_inflight_per_worker=4, max_queue=4))
    back = dict(link(0.001), peer="127.0.0.1:9001")  # the decode worker's link to p0
    health = {"http://p0": info("prefill", 9001, 1000.0, [link(0.001)]),
              "http://d": info("decode", DECODE_KV[1], 100.0, [back])}
    for w in pool.workers:
        pool.judge(w, Answer(info=health[w.url]))
    p0, dec = pool.workers
    assert "[report] 1.0 Mb/s + 1.0 ms" in d.paths.choose(dec, Prompt.cold(40), [p0]).why
    health["http://p0"]["links"] = []  # its connection to d closed
    pool.judge(p0, Answer(info=health["http://p0"]))
    assert "[none]" in d.paths.choose(dec, Prompt.cold(40), [p0]).why


def test_the_router_reads_the_links_its_health_checks_return(
        tiny_model: Callable[..., Path]) -> None:
    slow = FakeWorker(info("prefill", 9001, 1000.0, [link(0.001)]))
    fast = FakeWorker(info("prefill", 9002, 1000.0, [link(10.0, app_limited=True)]))
    dec = FakeWorker(info("decode", DECODE_KV[1], 500.0, []))

    async def go() -> None:
        async with fake_workers(slow, fast, dec) as urls:
            router = Router(RouterSettings(model=str(tiny_model()), served_model_name=NAME,
                                           prefill=tuple(urls[:2]), decode=(urls[2],),
                                           secret=SECRET))
            await router.start()  # one health round done
            try:
                p0, p1, d = (next(w for w in router.pool.workers if w.url == u) for u in urls)
                paths = router.dispatcher.paths
                # 1,000 tokens: 2 s on d, 1 s on p0 plus 512 kB at 125 kB/s (4.1 s)
                choice = paths.choose(d, Prompt.cold(1000), [p0])
                assert not choice.split and "[report]" in choice.why
                # p1's fast report is app-limited: p1 counts at the mean, p0's time
                assert paths.fastest_prefill(d, Prompt.cold(1000), [p0, p1]) == [p0, p1]
                # more bytes moved, and the sender filled the link this time
                fast.info = info("prefill", 9002, 1000.0, [link(10.0, nbytes=9_000_000)])
                await router.pool.refresh(router.session)
                assert paths.fastest_prefill(d, Prompt.cold(1000), [p0, p1]) == [p1]
            finally:
                await router.stop()

    asyncio.run(go())
