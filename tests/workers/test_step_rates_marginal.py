"""The marginal prefill rate a worker reports in its signed /health (`rates`): its prompt
steps' tokens over their seconds, less the decode part of the steps that also decoded, over
the same recent steps as its other rates; absent until measured."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.workers.server import Worker
from pdserve.workers.step_rates import StepRates, reported_rates
from pdserve.workers.step_trace import Step, StepTrace


def _step(at: float, seconds: float, prefill: int, decode: int) -> Step:
    return Step(at, at + seconds, prefill, decode, decode + (1 if prefill else 0), 0, 0)


def _history() -> list[Step]:
    """Oldest first: a 100-token prompt alone in 0.125 s, then two steps of 16 prompt tokens
    beside 3 streams in 60 ms each, then 40 ms decode-only steps: the decode step is 40 ms, so
    each mixed step's prompt part is 20 ms, and every prompt token went at 800 tokens/s."""
    return [_step(0.0, 0.125, 100, 0), _step(1.0, 0.060, 16, 3), _step(2.0, 0.060, 16, 3),
            *(_step(3.0 + i, 0.040, 0, 3) for i in range(5))]


def test_the_marginal_rate_takes_the_decode_part_off_the_mixed_steps() -> None:
    rates = reported_rates(reversed(_history()))
    assert rates.decode_step_s == pytest.approx(0.040)
    assert rates.prefill_marginal_tokens_per_s == pytest.approx(132 / 0.165)  # 800
    assert rates.prefill_tokens_per_s == pytest.approx(132 / 0.245)  # mixed steps whole: 539
    out = rates.to_json()
    assert out["prefill_marginal_tokens_per_s"] == pytest.approx(800.0)
    assert out["prefill_tokens_per_s"] == pytest.approx(132 / 0.245)
    assert out["decode_step_s"] == pytest.approx(0.040)


def test_before_any_stream_decoded_no_decode_part_is_taken_off() -> None:
    alone = [_step(0.0, 0.125, 100, 0), _step(1.0, 0.060, 16, 3)]  # no decode-only step yet
    rates = reported_rates(reversed(alone))
    assert rates.decode_step_s is None
    assert rates.prefill_marginal_tokens_per_s == pytest.approx(116 / 0.185)


def test_the_marginal_rate_is_absent_until_a_prompt_step_is_timed() -> None:
    assert reported_rates([]) == StepRates()
    decoding = reported_rates([_step(0.0, 0.04, 0, 3)])
    assert decoding.prefill_marginal_tokens_per_s is None
    assert "prefill_marginal_tokens_per_s" not in decoding.to_json()
    assert decoding.to_json() == {"prefill_tokens_per_s": None, "decode_step_s": 0.04}


def test_only_the_newest_window_of_prompt_steps_counts() -> None:
    old = [_step(t, 1.0, 100, 0) for t in range(10)]  # 100 tokens/s long ago
    new = [_step(10 + t, 0.1, 100, 0) for t in range(4)]  # 1,000 tokens/s now
    rates = reported_rates(reversed(old + new), window=4)
    assert rates.prefill_marginal_tokens_per_s == pytest.approx(1000.0)


def _worker(trace: StepTrace) -> SimpleNamespace:
    """What `Worker.info` reads of a worker, with the step trace given."""
    load = SimpleNamespace(kv_blocks_total=64, kv_blocks_used=0, running=0, waiting=0,
                           waiting_for_kv=0)
    config = SimpleNamespace(max_model_len=2048, block_size=16, dtype="bfloat16",
                             max_num_seqs=8, max_num_batched_tokens=512,
                             enable_chunked_prefill=False)
    engine = SimpleNamespace(role=SimpleNamespace(value="decode"), load=lambda: load,
                             config=config, prefill_chunk=32)
    loop = SimpleNamespace(flip=SimpleNamespace(state="serving"), num_legs=0, trace=trace,
                           pacer=SimpleNamespace(tpot_target_s=0.1))
    return SimpleNamespace(engine=engine, loop=loop, kv_layout=None, transport=None,
                           settings=SimpleNamespace(served_model_name="m"), load_seconds=1.0,
                           host="box/boot", own_cpus=[0])


def test_the_health_report_carries_the_marginal_rate_beside_the_others() -> None:
    trace = StepTrace(capacity=64)
    for step in _history():
        trace.record(step)
    rates = Worker.info(_worker(trace))["rates"]  # the health report of a worker as above
    assert rates["prefill_marginal_tokens_per_s"] == pytest.approx(800.0)
    assert rates["prefill_tokens_per_s"] == pytest.approx(132 / 0.245)
    assert rates["decode_step_s"] == pytest.approx(0.040)
