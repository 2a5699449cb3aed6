"""Calibration: fitting `pdserve bench engine --json` rows, the profile JSON, and simulating with
the fitted costs so that they reproduce the measured tok/s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.planner.simulate.calibration import (
    PROFILE_SCHEMA,
    BenchRows,
    CalibrationProfile,
    Chunk,
    fit_bench_rows,
    load_calibration,
    profile_from_dict,
)
from pdserve.planner.simulate.cluster import Cluster
from pdserve.planner.simulate.events import simulate
from pdserve.planner.simulate.trace import TraceRequest
from tests.planner.cli_run import run_pdserve

OVERHEAD, PER_SEQ, PREFILL_TOK_S = 0.020, 0.0005, 2000.0


def bench_rows(overhead: float = OVERHEAD, per_seq: float = PER_SEQ) -> list[dict]:
    """Rows as `pdserve bench engine --json` prints them, from a known linear machine."""
    rows = [{"phase": "decode", "batch": b, "prompt_tokens": 32,
             "pdserve_tok_s": b / (overhead + per_seq * b), "transformers_tok_s": 1.0,
             "roofline_tok_s": 1e4, "vs_transformers": 1.0, "of_roofline": 0.1}
            for b in (1, 8, 32)]
    rows.append({"phase": "prefill", "batch": 1, "prompt_tokens": 1000,
                 "pdserve_tok_s": PREFILL_TOK_S, "transformers_tok_s": 900.0,
                 "roofline_tok_s": 5000.0})
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_fit_recovers_the_linear_machine():
    p = fit_bench_rows(bench_rows())
    assert p.decode_overhead_s == pytest.approx(OVERHEAD, rel=1e-9)
    assert p.decode_per_seq_s == pytest.approx(PER_SEQ, rel=1e-9)
    assert p.prefill_overhead_s == 0 and p.prefill_per_token_s == pytest.approx(1 / 2000)
    assert p.max_rel_error == pytest.approx(0, abs=1e-9) and p.fit_rows == 4


def test_a_prefix_cache_row_counts_only_the_tokens_it_computed():
    rows = bench_rows()
    cached_row = {"phase": "prefill", "batch": 1, "prompt_tokens": 2048, "cached_tokens": 1024,
                  "pdserve_tok_s": PREFILL_TOK_S, "transformers_tok_s": None,
                  "roofline_tok_s": 5000.0}
    p = fit_bench_rows([*rows, cached_row])  # 1,024 computed tokens at the same rate
    assert p.prefill_per_token_s == pytest.approx(1 / PREFILL_TOK_S)
    assert p.max_rel_error == pytest.approx(0, abs=1e-9)


def test_profile_steps_reproduce_every_row_within_one_percent():
    rows = bench_rows()
    for context_s in (0.0, 3e-7):  # with and without a KV-read term
        p = fit_bench_rows(rows, context_token_s=context_s)
        for r in rows:
            b, n = r["batch"], r["prompt_tokens"]
            if r["phase"] == "decode":
                tok_s = b / p.step_seconds((), b, b * n)
            else:
                tok_s = b * n / p.step_seconds([Chunk(0, n, True)] * b, 0, 0)
            assert tok_s == pytest.approx(r["pdserve_tok_s"], rel=0.01)


def test_simulated_tok_s_reproduces_the_bench(tmp_path):
    profile = fit_bench_rows(bench_rows())
    cluster = Cluster(kv_capacity_tokens=10**6, kv_bytes_per_token_rank=1000, link_gbps=100,
                      collocated_workers=1)
    for batch in (1, 8, 32):
        trace = [TraceRequest(0.0, 32, 33)] * batch
        recs = simulate("colloc", cluster, profile, trace).records
        decode_s = recs[0].finish_s - recs[0].first_token_s  # 32 steps of the whole batch
        measured = next(r["pdserve_tok_s"] for r in bench_rows() if r.get("batch") == batch)
        assert batch * 32 / decode_s == pytest.approx(measured, rel=0.01)
    one = simulate("disagg", cluster, profile, [TraceRequest(0.0, 1000, 1)]).records[0]
    assert 1000 / one.ttft_s == pytest.approx(PREFILL_TOK_S, rel=0.01)


def test_noisy_rows_fit_by_relative_error():
    rows = bench_rows()
    rows[1]["pdserve_tok_s"] *= 1.02
    p = fit_bench_rows(rows)
    assert 0 < p.max_rel_error < 0.03
    assert p.decode_overhead_s == pytest.approx(OVERHEAD, rel=0.1)


def test_one_decode_batch_is_all_overhead_and_prefill_lengths_give_an_overhead():
    rows = [bench_rows()[1],
            {"phase": "prefill", "batch": 1, "prompt_tokens": 500, "pdserve_tok_s": 500 / 0.35},
            {"phase": "prefill", "batch": 2, "prompt_tokens": 1000, "pdserve_tok_s": 2000 / 1.1}]
    p = fit_bench_rows(rows)
    assert p.decode_per_seq_s == 0
    assert p.decode_overhead_s == pytest.approx(OVERHEAD + 8 * PER_SEQ)
    assert p.prefill_overhead_s == pytest.approx(0.1) and p.prefill_per_token_s == pytest.approx(
        0.0005)


def test_a_falling_step_time_clamps_the_slope_to_zero():
    rows = bench_rows(overhead=0.05, per_seq=-0.001)
    p = fit_bench_rows(rows)
    assert p.decode_per_seq_s == 0 and p.decode_overhead_s > 0


def test_a_mixed_step_pays_one_overhead():
    p = CalibrationProfile(decode_overhead_s=0.01, decode_per_seq_s=0.001,
                           prefill_per_token_s=1e-4, prefill_overhead_s=0.02,
                           decode_per_context_token_s=1e-6)
    mixed = p.step_seconds([Chunk(0, 100, True)], 4, 1000)
    assert mixed == pytest.approx(0.02 + 100e-4 + 4e-3 + 1e-3)


def test_streams_past_the_knee_pay_their_extra_cost():
    p = CalibrationProfile(decode_overhead_s=0.01, decode_per_seq_s=0.001,
                           prefill_per_token_s=1e-4, decode_knee_batch=4,
                           decode_per_seq_past_knee_s=0.002)
    assert p.step_seconds([], 3, 0) == pytest.approx(0.01 + 3e-3)
    assert p.step_seconds([], 4, 0) == pytest.approx(0.01 + 4e-3)
    assert p.step_seconds([], 10, 0) == pytest.approx(0.01 + 10e-3 + 6 * 2e-3)
    assert p.step_seconds([Chunk(0, 100, True)], 6, 0) == pytest.approx(0.01 + 1e-2 + 6e-3
                                                                         + 2 * 2e-3)
    assert "0.001 ms/seq" not in p.describe() and "(+2.000 past 4 streams)" in p.describe()


def test_a_chunk_pays_for_the_pairs_it_attends_to():
    p = CalibrationProfile(decode_overhead_s=0.01, decode_per_seq_s=0.001,
                           prefill_per_token_s=1e-4, prefill_per_attention_pair_s=1e-8)
    # 100 tokens after 300: 100 x 300 + 100 x 101 / 2 pairs; a second whole prompt of 10
    step = p.step_seconds([Chunk(300, 100, False), Chunk(0, 10, True)], 0, 0)
    assert step == pytest.approx(110e-4 + 1e-8 * (30_000 + 5_050 + 55))


def test_profile_json_round_trip(tmp_path):
    with_pairs = CalibrationProfile(decode_overhead_s=0.01, decode_per_seq_s=0.001,
                                    prefill_per_token_s=1e-4, prefill_per_attention_pair_s=3e-9)
    assert profile_from_dict(with_pairs.to_dict()) == with_pairs
    bent = CalibrationProfile(decode_overhead_s=0.01, decode_per_seq_s=0.001,
                              prefill_per_token_s=1e-4, decode_knee_batch=6,
                              decode_per_seq_past_knee_s=5e-4)
    assert profile_from_dict(bent.to_dict()) == bent
    p = fit_bench_rows(bench_rows(), 1e-7, source="bench", model="smollm2-135m", gpu="cpu")
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(p.to_dict()))
    assert load_calibration(path) == p
    minimal = {"schema": PROFILE_SCHEMA, "decode": {"overhead_s": 0.01, "per_seq_s": 0},
               "prefill": {"per_token_s": 1e-3}}
    assert profile_from_dict(minimal).tp == 1


def test_bench_rows_file_is_recognised(tmp_path):
    got = load_calibration(write_rows(tmp_path / "bench.jsonl", bench_rows()))
    assert isinstance(got, BenchRows) and len(got.rows) == 4


@pytest.mark.parametrize(("patch", "message"), [
    ({"schema": "v0"}, "schema must be"),
    ({"decode": {"overhead_s": 0.01}}, "decode is missing per_seq_s"),
    ({"decode": {"overhead_s": -1, "per_seq_s": 0}}, r"decode\.overhead_s must be"),
    ({"decode": {"overhead_s": 0, "per_seq_s": 0}}, "must be positive"),
    ({"prefill": {"per_token_s": 0}}, r"prefill\.per_token_s must be positive"),
    ({"prefill": {"per_token_s": "fast"}}, r"prefill\.per_token_s must be a finite"),
    ({"tp": 0}, "tp must be an integer"),
    ({"model": 7}, "model must be a string"),
    ({"prefill": 3}, "needs 'decode' and 'prefill' objects"),
    ({"decode": {"overhead_s": 0.01, "per_seq_s": 0, "knee_batch": -1}},
     r"decode\.knee_batch must be an integer >= 0, got -1"),
    ({"decode": {"overhead_s": 0.01, "per_seq_s": 0, "knee_batch": 2.5}}, "got 2.5"),
    ({"decode": {"overhead_s": 0.01, "per_seq_s": 0, "per_seq_past_knee_s": 1e-3}},
     r"per_seq_past_knee_s needs a decode\.knee_batch >= 1"),
    ({"decode": {"overhead_s": 0.01, "per_seq_s": 0, "knee_batch": 4,
                 "per_seq_past_knee_s": -1}}, r"decode\.per_seq_past_knee_s must be"),
])
def test_bad_profiles_name_the_field(patch, message):
    good = {"schema": PROFILE_SCHEMA, "decode": {"overhead_s": 0.01, "per_seq_s": 0.001},
            "prefill": {"per_token_s": 1e-3}}
    with pytest.raises(ValueError, match=message):
        profile_from_dict(good | patch)


@pytest.mark.parametrize(("rows", "message"), [
    ([{"phase": "train"}], "row 1: expected a `pdserve bench engine --json` row"),
    ([{"phase": "decode", "batch": 0, "prompt_tokens": 1, "pdserve_tok_s": 1}],
     "row 1: batch must be a positive integer"),
    ([{"phase": "decode", "batch": 1, "prompt_tokens": 1}], "pdserve_tok_s must be a positive"),
    ([{"phase": "prefill", "batch": 1, "prompt_tokens": 8, "pdserve_tok_s": 1,
       "cached_tokens": 8}], r"cached_tokens must be an integer in \[0, prompt_tokens\)"),
    (bench_rows()[:3], "no prefill row to fit"),
    (bench_rows()[3:], "no decode row to fit"),
])
def test_bad_bench_rows_raise(rows, message):
    with pytest.raises(ValueError, match=message):
        fit_bench_rows(rows)


def test_bad_calibration_files(tmp_path):
    with pytest.raises(ValueError, match=r"calibrate \(--calibrate\) .* cannot be read"):
        load_calibration(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text(json.dumps(bench_rows()[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        load_calibration(tmp_path / "bad.jsonl")


# ---- through the CLI ----------------------------------------------------------------------------


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    return run_pdserve(["simulate", *argv], capsys)


def test_cli_calibrates_from_bench_rows_and_writes_a_profile(tmp_path, capsys):
    bench = write_rows(tmp_path / "bench.jsonl", bench_rows())
    profile = tmp_path / "profile.json"
    rc, out, err = run_cli(["--calibrate", str(bench), "--model", "smollm2-135m", "--gpu", "cpu",
                            "--workload", "fixed", "--prompt-tokens", "1000", "--output-tokens",
                            "1", "--rate", "0.1", "--num-requests", "1", "--json"], capsys)
    assert rc == 0, err
    got = json.loads(out)
    assert got["costs"]["kind"] == "calibrated" and got["costs"]["gpu"] == "cpu"
    assert got["results"][0]["mean_ttft_ms"] == pytest.approx(500, rel=0.01)  # 2000 tok/s
    rc, _, err = run_cli(["--calibrate", str(bench), "--model", "smollm2-135m", "--gpu", "cpu",
                          "--write-profile", str(profile), "--duration-s", "5"], capsys)
    assert rc == 0, err
    saved = load_calibration(profile)
    assert saved.model == "smollm2-135m" and saved.decode_per_context_token_s > 0
    rc, out, err = run_cli(["--calibrate", str(profile), "--duration-s", "5"], capsys)
    assert rc == 0 and "calibrated" in out and "smollm2-135m" in out


def test_cli_bench_rows_need_the_device(tmp_path, capsys):
    bench = write_rows(tmp_path / "bench.jsonl", bench_rows())
    rc, out, err = run_cli(["--calibrate", str(bench), "--model", "smollm2-135m"], capsys)
    assert rc == 2 and out == "" and "gpu (--gpu) is required" in err


def test_bench_rows_of_several_prompt_lengths_fit_the_attention_pairs():
    """Rows at 512 to 8,191 tokens and a half-cached 2,048 from a machine whose prefill step is
    overhead + per token + per pair are reproduced exactly, and the pairs are priced."""
    p0, p1, pa = 0.01, 4e-4, 5e-9
    rows = bench_rows()[:3]
    for prompt, cached in ((512, 0), (1000, 0), (2048, 0), (8191, 0), (2048, 1024)):
        n = prompt - cached
        seconds = p0 + p1 * n + pa * (n * cached + n * (n + 1) // 2)
        rows.append({"phase": "prefill", "batch": 1, "prompt_tokens": prompt,
                     "cached_tokens": cached, "pdserve_tok_s": n / seconds})
    p = fit_bench_rows(rows)
    assert p.prefill_overhead_s == pytest.approx(p0, rel=1e-6)
    assert p.prefill_per_token_s == pytest.approx(p1, rel=1e-6)
    assert p.prefill_per_attention_pair_s == pytest.approx(pa, rel=1e-6)
    assert p.max_rel_error == pytest.approx(0, abs=1e-9)
