"""`pdserve bench attention`: its settings refuse what the kernel cannot run, and a run prints
one row per length with both sides timed over the same causal pairs."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.attention_bench import AttentionSettings, runs_here
from pdserve.cli import main
from pdserve.engine import kernels


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"lengths": ()}, "prompt lengths must be positive"),
    ({"cached": -1}, "cached must be >= 0"),
    ({"heads": 9, "kv_heads": 2}, r"heads \(9\) must be a positive multiple of kv_heads \(2\)"),
    ({"head_dim": 96}, "multiples of 64, not 96"),
    ({"repeats": 0}, "repeats must be positive"),
    ({"kernel": "sse"}, "kernel must be one of amx, avx512_bf16, avx2, not 'sse'"),
])
def test_bad_settings_say_what_to_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AttentionSettings(**kwargs)


def test_a_run_prints_a_row_per_length_with_the_causal_flops(capsys):
    ops = kernels.cpu_ops()
    if ops is None or not ops.prefill_attention_available():
        pytest.skip("this CPU has neither AVX512-BF16 nor AVX2 and FMA: no compiled prefill "
                    "attention to measure")
    assert main(["bench", "attention", "--prompt-lens", "40,100", "--cached", "30",
                 "--repeats", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompt_tokens"], r["cached_tokens"]) for r in rows] == [(40, 30), (100, 30)]
    for r in rows:  # 4 x heads x head_dim per (query, key) pair: n x cached + n (n + 1) / 2
        n = r["prompt_tokens"]
        assert r["flops"] == 4 * 9 * 64 * (n * 30 + n * (n + 1) / 2)
        assert r["pdserve_ms"] > 0 and r["sdpa_ms"] > 0


@pytest.mark.parametrize("kernel", ["amx", "avx512_bf16", "avx2"])
def test_a_named_kernel_is_timed_where_the_cpu_runs_it(capsys, kernel):
    ops = kernels.cpu_ops()
    assert ops is not None
    argv = ["bench", "attention", "--prompt-lens", "40", "--repeats", "1", "--kernel", kernel]
    if not runs_here(ops, kernel):
        assert main(argv) == 1
        assert f"does not run the {kernel} kernel" in capsys.readouterr().err
        return
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr()
    assert f"pdserve's kernel on {kernel}" in out.err
    assert json.loads(out.out)["prompt_tokens"] == 40
