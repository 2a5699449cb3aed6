"""`pdserve bench moe` on a small shape: every row says which experts its steps read (recorded,
at most top_k x batch distinct per layer), the bytes they needed and what reading every expert
would have cost; and `pdserve bench transfer`'s KV-bytes-per-token rows."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.kv_per_token import kv_per_token_rows
from pdserve.bench.moe_bench import WeightBytes, weight_bytes
from pdserve.bench.moe_models import MoeBenchShape
from pdserve.cli import main

FIELDS = {"kind", "model", "batch", "top_k", "step_ms", "active_experts_mean",
          "active_experts_max", "dense_bytes", "expert_bytes", "kv_bytes", "required_bytes",
          "dense_equivalent_bytes", "bandwidth_gbps", "baseline", "effective_bytes", "ratio",
          "saving"}


def test_a_small_run_reports_the_chosen_experts_and_their_bytes(capsys):
    assert main(["bench", "moe", "--hidden", "128", "--experts", "16", "--expert-width", "32",
                 "--layers", "3", "--batches", "1,3", "--prompt-len", "5",
                 "--decode-steps", "3", "--repeats", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {(r["model"], r["batch"]) for r in rows} == {
        (m, b) for m in ("deepseek_v3", "qwen3_moe") for b in (1, 3)}
    for r in rows:
        assert set(r) == FIELDS and r["kind"] == "moe_decode"
        moe_layers = 2 if r["model"] == "deepseek_v3" else 3  # DeepSeek's first layer is dense
        assert len(r["active_experts_max"]) == len(r["active_experts_mean"]) == moe_layers
        assert all(1 <= n <= min(16, r["top_k"] * r["batch"]) for n in r["active_experts_max"])
        if r["batch"] == 1:  # one token: exactly its top_k experts in every layer
            assert r["active_experts_mean"] == [r["top_k"]] * moe_layers
        assert r["required_bytes"] == r["dense_bytes"] + r["expert_bytes"] + r["kv_bytes"]
        assert r["dense_equivalent_bytes"] > r["required_bytes"] > r["dense_bytes"] > 0
        assert r["step_ms"] > 0 and r["bandwidth_gbps"] > 0 and r["ratio"] > 0


def test_step_bytes_count_the_chosen_experts_and_the_embedding_rows():
    sizes = {"model.embed_tokens.weight": 10 * 4, "lm_head.weight": 10 * 4,
             "model.norm.weight": 4} | {
        f"model.layers.{lay}.mlp.experts.{e}.{p}_proj.weight": 6
        for lay in (1, 2) for e in range(5) for p in ("gate", "up", "down")}
    weights = weight_bytes(sizes, vocab_size=10)
    assert weights == WeightBytes(dense=44, embedding_row=4, expert={1: 18, 2: 18},
                                  num_experts=5)
    assert weights.step(2, {1: 3, 2: 1}) == 44 + 2 * 4 + 18 * 4
    assert weights.dense_equivalent(1) == 44 + 4 + 18 * 10


@pytest.mark.parametrize(("fields", "message"), [
    ({"hidden_size": 100}, "multiple of 128"),
    ({"num_experts": 12}, "multiple of 8, at least 8"),
    ({"num_layers": 1}, "at least 2"),
])
def test_bad_shapes_say_what_to_fix(fields, message):
    with pytest.raises(ValueError, match=message):
        MoeBenchShape(**fields)


def test_kv_per_token_rows_compare_the_latent_pool_with_a_gqa_twin():
    """Published DeepSeek-V3 (61 layers, latent 512 + 64) against 32 KV heads of 192:
    61 x 576 x 2 bytes against 61 x 2 x 32 x 192 x 2, each the engine's pool and the
    planner's figure alike (kv_per_token_rows raises when they differ)."""
    rows = {r.model: r for r in kv_per_token_rows()}
    v3 = rows["deepseek-v3"]
    assert (v3.mla_bytes, v3.gqa_bytes) == (61 * 576 * 2, 61 * 2 * 32 * 192 * 2)
    assert v3.ratio <= 1 / 4
    bench = rows["bench-moe deepseek_v3"]  # hidden 1024: 8 heads, latent 256 + 64, 4 layers
    assert (bench.mla_bytes, bench.gqa_kv_heads, bench.gqa_bytes) == (
        4 * 320 * 2, 2, 4 * 2 * 2 * 192 * 2)


def test_transfer_bench_emits_the_kv_per_token_rows(capsys):
    assert main(["bench", "transfer", "--sizes", "1", "--repeats", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    kv = {r["model"]: r for r in rows if r.get("kind") == "kv_per_token"}
    assert set(kv) == {"deepseek-v3", "bench-moe deepseek_v3"}
    assert kv["deepseek-v3"] | {"ratio": None} == {
        "kind": "kv_per_token", "model": "deepseek-v3", "layers": 61, "heads": 128,
        "mla_bytes": 70272, "gqa_kv_heads": 32, "gqa_head_dim": 192, "gqa_bytes": 1499136,
        "ratio": None}
    assert kv["deepseek-v3"]["ratio"] == pytest.approx(70272 / 1499136, abs=1e-4)
