"""The router's per-request choice of path: a fixed threshold when given, else the measured
costs the workers report, with the fixed rule's default until they are measured."""

from __future__ import annotations

import os

from pdserve.internal_auth import InternalAuth
from pdserve.router.path_choice import UNMEASURED_THRESHOLD, PathChoice, Prompt, Reason
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.worker_pool import WorkerPool

cold = Prompt.cold  # a prompt no worker holds any of

LAYOUT = {"model_id": "m", "dtype": "bfloat16", "block_size": 16, "num_layers": 30,
          "kv_heads": 3, "head_dim": 64}


def _pool() -> WorkerPool:
    pool = WorkerPool({"prefill": ["http://127.0.0.1:9001"], "decode": ["http://127.0.0.1:9002"]},
                      InternalAuth(os.urandom(32)), "m")
    pool.reference = {"kv_layout": LAYOUT}
    return pool


def _rates(worker, prefill_tps: float, decode_step_s: float | None = None) -> None:
    worker.info = {"rates": {"prefill_tokens_per_s": prefill_tps, "decode_step_s": decode_step_s},
                   "chunk_tokens": None}


def test_a_given_threshold_is_the_rule() -> None:
    pool = _pool()
    pre, dec = pool.workers
    paths = PathChoice(pool, threshold=100, tpot_target_s=0.1)
    assert paths.choose(dec, cold(101), [pre]).split
    assert not paths.choose(dec, cold(100), [pre]).split


def test_unmeasured_workers_get_the_default_threshold() -> None:
    pool = _pool()
    pre, dec = pool.workers
    paths = PathChoice(pool, threshold=None, tpot_target_s=0.1)
    choice = paths.choose(dec, cold(UNMEASURED_THRESHOLD + 1), [pre])
    assert choice.split and choice.decision is None and "not measured" in choice.why
    assert not paths.choose(dec, cold(UNMEASURED_THRESHOLD), [pre]).split


def test_an_unmeasured_burst_of_short_prompts_is_shared_with_the_prefill_worker() -> None:
    """Sixteen 160-token prompts at once, before any rate: the decode worker takes one, then
    one each time its queue is no longer than the prefill worker's would be: 8 and 8, where
    the fixed threshold alone queued all 16 on the decode worker."""
    pool = _pool()
    pre, dec = pool.workers
    paths = PathChoice(pool, threshold=None, tpot_target_s=0.1)
    split = []
    for _ in range(16):
        choice = paths.choose(dec, cold(160), [pre])
        assert choice.reason is Reason.UNMEASURED
        split.append(choice.split)
        paths.prefilling(pre if choice.split else dec, 160)
    assert split == [False, True] * 8
    assert "1440 queued here with them against 1440 on the least loaded prefill" in \
        paths.choose(dec, cold(160), [pre]).why


def test_an_unmeasured_decode_worker_whose_queue_drained_takes_prompts_again() -> None:
    pool = _pool()
    pre, dec = pool.workers
    paths = PathChoice(pool, threshold=None, tpot_target_s=0.1)
    done = paths.prefilling(dec, 200)
    assert paths.choose(dec, cold(100), [pre]).split  # 300 > max(256, 100)
    done()  # its first token came: the prompt left the queue
    assert not paths.choose(dec, cold(100), [pre]).split


def test_measured_rates_and_the_router_s_backlog_decide() -> None:
    pool = _pool()
    pre, dec = pool.workers
    _rates(pre, 1000.0)
    _rates(dec, 1000.0, 0.02)
    paths = PathChoice(pool, threshold=None, tpot_target_s=0.1)
    assert paths.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    dec.inflight = 2  # streams there: a whole 1,000-token prefill would stall them ~1 s
    assert paths.choose(dec, cold(1000), [pre]).split
    dec.inflight = 0  # idle: local saves the transfer
    assert not paths.choose(dec, cold(1000), [pre]).split
    _rates(dec, 500.0, 0.02)
    dec.info["chunk_tokens"] = 32  # chunked: +64 ms a step, allowed beside its streams
    dec.inflight = 2
    assert paths.choose(dec, cold(1000), [pre]).split  # 2 s locally against 1 s split
    finished = paths.prefilling(pre, 5000)  # the prefill worker is 5 s behind
    assert not paths.choose(dec, cold(1000), [pre]).split
    finished()
    finished()
    assert paths.backlog.tokens(pre.key) == 0
    paths.handed_over(pre, dec, 1000, 1.5)  # a slow link: 1.5 s to move 1,000 tokens' KV
    assert not paths.choose(dec, cold(1000), [pre]).split


def test_each_worker_counts_the_prompt_s_tokens_it_lacks() -> None:
    pool = _pool()
    pre, dec = pool.workers
    _rates(pre, 1000.0)
    _rates(dec, 67.0, 0.02)
    paths = PathChoice(pool, threshold=None, tpot_target_s=0.1)
    held_by_dec = Prompt(1760, lambda w: 10 if w is dec else 1754)
    choice = paths.choose(dec, held_by_dec, [pre])  # 0.15 s locally against 1.75 s split
    assert not choice.split and choice.decision is not None
    assert "U_d 10 " in choice.why and "U_p 1754 " in choice.why and "N 1760 " in choice.why
    held_by_both = Prompt(1760, lambda w: 10)
    assert paths.choose(dec, held_by_both, [pre]).split  # 0.15 s locally against 0.01 s
    assert paths.fastest_prefill(dec, held_by_both, [pre]) == [pre]


def _sample(metrics: RouterMetrics, line: str) -> float:
    """The value of one sample line of /metrics, by its name and labels."""
    text = metrics.registry.render()
    return float(next(s for s in text.splitlines() if s.startswith(line + " ")).split()[-1])


def test_each_rule_is_counted_once_per_recorded_choice() -> None:
    pool = WorkerPool({"prefill": ["http://127.0.0.1:9001"], "decode": ["http://127.0.0.1:9002"],
                       "collocated": ["http://127.0.0.1:9003"]},
                      InternalAuth(os.urandom(32)), "m")
    pre, dec, col = pool.workers
    metrics = RouterMetrics()
    fixed = PathChoice(pool, threshold=100, tpot_target_s=0.1, metrics=metrics)
    measured = PathChoice(pool, threshold=None, tpot_target_s=0.1, metrics=metrics)
    choices = [fixed.choose(col, cold(500), [pre]), fixed.choose(dec, cold(500), []),
               fixed.choose(dec, cold(500), [pre]), fixed.choose(dec, cold(50), [pre]),
               measured.choose(dec, cold(UNMEASURED_THRESHOLD + 1), [pre])]
    assert [(c.split, c.reason) for c in choices] == [
        (False, Reason.COLLOCATED_WORKER), (False, Reason.NO_PREFILL_WORKER),
        (True, Reason.THRESHOLD), (False, Reason.THRESHOLD), (True, Reason.UNMEASURED)]
    assert "collocated worker" in choices[0].why and "no prefill worker" in choices[1].why
    assert metrics.split_decisions.value(path="disaggregated", reason="threshold") == 0
    for choice in choices:
        fixed.record(choice)
    counts = {(path, reason): 1.0 for path, reason in [
        ("local", "collocated_worker"), ("local", "no_prefill_worker"),
        ("disaggregated", "threshold"), ("local", "threshold"),
        ("disaggregated", "unmeasured")]}
    for (path, reason), n in counts.items():
        assert metrics.split_decisions.value(path=path, reason=reason) == n
    assert metrics.split_estimate.count(path="local") == 0  # no measured-cost decision yet


def test_a_measured_cost_decision_records_both_paths_estimates() -> None:
    pool = _pool()
    pre, dec = pool.workers
    _rates(pre, 1000.0)
    _rates(dec, 500.0, 0.02)
    metrics = RouterMetrics()
    paths = PathChoice(pool, threshold=None, tpot_target_s=0.1, metrics=metrics)
    idle = paths.choose(dec, cold(1000), [pre])  # 2 s locally against 1 s split
    assert idle.split and idle.reason == Reason.MEASURED_COST
    dec.inflight = 2  # a whole 1,000-token prefill would stall its 2 streams for 2 s
    # 0.5 s locally against 0.25 s split, and 0.52 s steps
    busy = paths.choose(dec, cold(250), [pre])
    assert busy.split and busy.reason == Reason.TPOT_TARGET
    paths.record(idle)
    paths.record(busy)
    paths.record(paths.choose(dec, cold(250), []))  # no estimates without a decision
    assert metrics.split_decisions.value(path="disaggregated", reason="measured_cost") == 1
    assert metrics.split_decisions.value(path="disaggregated", reason="tpot_target") == 1
    assert _sample(metrics, 'pdserve_router_split_estimate_seconds_sum{path="local"}') == 2.5
    assert _sample(metrics, 'pdserve_router_split_estimate_seconds_sum{path="disaggregated"}'
                   ) == 1.25
    assert _sample(metrics, 'pdserve_router_split_estimate_seconds_bucket'
                            '{path="local",le="0.5"}') == 1
    assert _sample(metrics, 'pdserve_router_split_estimate_seconds_count{path="local"}') == 2


def test_without_metrics_recording_is_a_no_op() -> None:
    pool = _pool()
    pre, dec = pool.workers
    paths = PathChoice(pool, threshold=100, tpot_target_s=0.1)
    paths.record(paths.choose(dec, cold(500), [pre]))
