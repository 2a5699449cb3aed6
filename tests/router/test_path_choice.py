"""The router's per-request choice of path: a fixed threshold when given, else the measured
costs the workers report, with the fixed rule's default until they are measured."""

from __future__ import annotations

import os

from pdserve.internal_auth import InternalAuth
from pdserve.router.path_choice import UNMEASURED_THRESHOLD, PathChoice
from pdserve.router.worker_pool import WorkerPool

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
    assert paths.choose(dec, 101, [pre]).split and not paths.choose(dec, 100, [pre]).split


def test_unmeasured_workers_get_the_default_threshold() -> None:
    pool = _pool()
    pre, dec = pool.workers
    paths = PathChoice(pool, threshold=None, tpot_target_s=0.1)
    choice = paths.choose(dec, UNMEASURED_THRESHOLD + 1, [pre])
    assert choice.split and choice.decision is None and "not measured" in choice.why
    assert not paths.choose(dec, UNMEASURED_THRESHOLD, [pre]).split


def test_measured_rates_and_the_router_s_backlog_decide() -> None:
    pool = _pool()
    pre, dec = pool.workers
    _rates(pre, 1000.0)
    _rates(dec, 1000.0, 0.02)
    paths = PathChoice(pool, threshold=None, tpot_target_s=0.1)
    assert paths.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    dec.inflight = 2  # streams there: a whole 1,000-token prefill would stall them ~1 s
    assert paths.choose(dec, 1000, [pre]).split
    dec.inflight = 0  # idle: local saves the transfer
    assert not paths.choose(dec, 1000, [pre]).split
    _rates(dec, 500.0, 0.02)
    dec.info["chunk_tokens"] = 32  # chunked: +64 ms a step, allowed beside its streams
    dec.inflight = 2
    assert paths.choose(dec, 1000, [pre]).split  # 2 s locally against 1 s split
    finished = paths.prefilling(pre, 5000)  # the prefill worker is 5 s behind
    assert not paths.choose(dec, 1000, [pre]).split
    finished()
    finished()
    assert paths.backlog.tokens(pre.key) == 0
    paths.handed_over(1000, 1.5)  # a slow link: 1.5 s to move 1,000 tokens' KV
    assert not paths.choose(dec, 1000, [pre]).split
