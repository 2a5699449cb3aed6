"""Two configurations of one `bench compare` run, request by request: which requests met the
SLO under one only, and whether the run tells the two apart (exact McNemar)."""

from __future__ import annotations

import pytest

from pdserve.bench.paired_goodput import Paired, mcnemar_p, met_slo, paired


@pytest.mark.parametrize(("only_a", "only_b", "p"), [
    (8, 2, 2 * (1 + 10 + 45) / 2**10),  # 0.109
    (2, 0, 0.5),
    (10, 0, 2 / 2**10),
    (0, 0, 1.0),  # nothing discordant: nothing to tell
    (5, 5, 1.0),  # the two-sided sum passes 1
])
def test_the_exact_two_sided_test_counts_only_the_discordant_requests(only_a, only_b, p):
    assert mcnemar_p(only_a, only_b) == pytest.approx(p, rel=1e-12)
    assert mcnemar_p(only_b, only_a) == mcnemar_p(only_a, only_b)


def record(ttft_s: float | None, tpot_s: float | None = 0.05, ok: bool = True,
           e2e_s: float = 3.0) -> dict:
    return {"ttft_s": ttft_s, "tpot_s": tpot_s, "e2e_s": e2e_s, "ok": ok}


def result(*records: dict, **slo: float) -> dict:
    return {"requests": list(records), **{f"slo_{k}_ms": v for k, v in slo.items()}}


def test_a_request_meets_the_slo_as_bench_serve_counts_goodput():
    run = result(record(2.0), record(2.001), record(0.1, tpot_s=0.1001), record(0.1, None),
                 record(0.5, None, ok=False), record(0.1, e2e_s=9.0),
                 ttft=2000.0, tpot=100.0, e2e=5000.0)
    # bounds included; one output token has no TPOT (counted 0); a failed request never meets,
    # even one that broke after its first token
    assert met_slo(run) == [True, False, False, True, False, False]
    assert met_slo(result(record(50.0), record(None, ok=False))) == [True, False]  # no SLO


def test_two_configurations_pair_by_trace_position():
    slo = {"ttft": 2000.0, "tpot": 100.0}
    results = {"disagg": result(record(1.0), record(1.0), record(3.0), record(1.0), **slo),
               "colloc": result(record(3.0), record(1.0), record(1.0), record(3.0), **slo)}
    assert paired(results, "disagg", "colloc") == Paired("disagg", "colloc", 2, 1, 1.0)
    assert paired(results, "colloc", "disagg") == Paired("colloc", "disagg", 1, 2, 1.0)
    results["short"] = result(record(1.0), **slo)
    assert paired(results, "disagg", "short") is None  # not the same trace
    assert paired(results, "disagg", "missing") is None


def rounds(*runs: list[dict], **slo: float) -> dict:
    """A repeated configuration's results: each round's requests under `repeats`, the last
    round's also at the top (bench compare's combine_repeats)."""
    return {**result(*runs[-1], **slo), "repeats": [{"requests": list(r)} for r in runs]}


def test_repeated_runs_pair_every_round_and_sum_the_discordant_requests():
    slo = {"ttft": 2000.0, "tpot": 100.0}
    ok, late = record(1.0), record(3.0)
    results = {"a": rounds([ok, ok, late], [ok, ok, ok], **slo),
               "b": rounds([late, ok, ok], [late, late, ok], **slo)}
    # round 1: a only 1, b only 1; round 2: a only 2
    assert paired(results, "a", "b") == Paired("a", "b", 3, 1, mcnemar_p(3, 1), 2)
    del results["b"]["repeats"][0]["requests"]  # a round without records: the last alone
    assert paired(results, "a", "b") == Paired("a", "b", 2, 0, 0.5)
    results["b"] = rounds([late, ok, ok], **slo)  # rounds that do not match: the last alone
    assert paired(results, "a", "b") == Paired("a", "b", 1, 0, 1.0)
