"""The elastic controller's observation of the pools (`elastic_controller.observe`): the rate
each worker counts at in the prefill stage. A decode-capable worker counts at the rate a prompt
gets there beside the legs it has open now (from its marginal rate R_m and decode step, as the
split decision prices a local prefill), not at its average over its last prompt steps, which
keeps the streams that ran beside them however long ago."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.router.admission import AdmissionQueue
from pdserve.router.admission_settings import AdmissionSettings
from pdserve.router.elastic_controller import observe, stage_rate, typical_prompt
from pdserve.router.elastic_window import Window
from pdserve.router.split_decision import PrefillBacklog, Sent, Speed
from pdserve.router.worker_pool import WorkerHandle

# What an idle decode worker reported after pacing 16-token chunks beside a few streams:
# an average of 39 tokens/s, a marginal rate of 100 and a 50 ms decode step.
STALE = {"prefill_tokens_per_s": 39.0, "decode_step_s": 0.05,
         "prefill_marginal_tokens_per_s": 100.0}


def _worker(role: str, rates: dict[str, float], inflight: int = 0,
            chunk: int | None = None) -> WorkerHandle:
    info: dict[str, object] = {"rates": rates, "kv_blocks_used": 3, "kv_blocks_total": 100}
    if chunk is not None:
        info["chunk_tokens"] = chunk
    w = WorkerHandle(f"http://127.0.0.1:{9000 + inflight}", role, healthy=True, info=info)
    w.key, w.inflight = f"{role}-{inflight}", inflight
    return w


def _observe(workers: list[WorkerHandle], window: Window) -> dict[str, float | None]:
    pool = SimpleNamespace(workers=workers)  # what `observe` reads of the pool
    settings = AdmissionSettings()
    queues = {name: AdmissionQueue(name, lambda: [], settings) for name in ("prefill", "decode")}
    seen = observe(pool, queues, PrefillBacklog(), now=0.0, window=window)
    return {v.key: v.prefill_tokens_per_s for v in seen.workers}


def test_an_idle_decode_worker_counts_at_its_marginal_rate_not_its_stale_average() -> None:
    rates = _observe([_worker("decode", STALE)], Window(10.0, {"decode-0": Sent(2, 600)}))
    assert rates == {"decode-0": pytest.approx(100.0)}


def test_a_streaming_decode_worker_counts_at_the_rate_its_open_legs_leave() -> None:
    """Four legs open, 16-token chunks: each step carries 16 prompt tokens and the 50 ms decode
    step, 16 / (0.05 + 16 / 100) = 76 tokens/s; without chunks a 300-token prompt runs in one
    step beside the streams, 300 / (0.05 + 3) = 98."""
    window = Window(10.0, {"decode-4": Sent(2, 600)})
    chunked = _observe([_worker("decode", STALE, inflight=4, chunk=16)], window)
    assert chunked == {"decode-4": pytest.approx(16 / (0.05 + 0.16))}
    whole = _observe([_worker("collocated", STALE, inflight=4)], window)
    assert whole == {"collocated-4": pytest.approx(300 / (0.05 + 3.0))}


def test_a_prefill_worker_and_a_worker_without_r_m_count_at_their_measured_rate() -> None:
    old = {"prefill_tokens_per_s": 39.0, "decode_step_s": 0.05}
    rates = _observe([_worker("prefill", STALE), _worker("decode", old, inflight=2)], Window())
    assert rates == {"prefill-0": 39.0, "decode-2": 39.0}


def test_the_typical_prompt_is_the_windows_mean_then_the_pools() -> None:
    window = Window(10.0, {"a": Sent(2, 500), "b": Sent(1, 400)})
    assert typical_prompt(window, 1000.0) == 300
    assert typical_prompt(Window(), 1000.0) == 1000
    assert typical_prompt(Window(), 0.0) == 0


def test_a_prompt_of_unknown_length_counts_at_a_chunk_or_at_r_m() -> None:
    speed = Speed(39.0, 0.05, running=4, chunk_tokens=16, prefill_marginal_tokens_per_s=100.0)
    assert stage_rate("decode", speed, 0) == pytest.approx(16 / (0.05 + 0.16))
    whole = Speed(39.0, 0.05, running=4, prefill_marginal_tokens_per_s=100.0)
    assert stage_rate("decode", whole, 0) == 100.0
