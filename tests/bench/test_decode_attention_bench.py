"""`pdserve bench decode-attention`: settings refuse what the kernel cannot run, and a run times
the kernel, the PyTorch path and a plain read of the same bytes for every batch and context."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.decode_attention_bench import DecodeAttentionSettings
from pdserve.cli import main
from pdserve.engine import kernels


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"heads": 8, "kv_heads": 3}, r"heads \(8\) must be a positive multiple of kv_heads \(3\)"),
    ({"heads": 16, "kv_heads": 1}, "not 64 and 16"),
    ({"head_dim": 96}, "head sizes 64 and 128"),
    ({"batches": (0,)}, "batches must be positive"),
    ({"contexts": ()}, "contexts must be positive"),
    ({"repeats": 0}, "repeats must be positive"),
])
def test_bad_settings_say_what_to_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodeAttentionSettings(**kwargs)


def test_a_bad_shape_flag_is_an_error_with_the_expected_form(capsys):
    assert main(["bench", "decode-attention", "--shape", "9,3"]) == 2
    assert "pdserve: error: --shape takes three integers" in capsys.readouterr().err


def test_a_run_times_each_batch_and_context_against_pytorch_and_a_read(capsys):
    if kernels.cpu_ops() is None:
        pytest.skip("no C++ compiler here: no compiled operators to measure")
    assert main(["bench", "decode-attention", "--batches", "1,3", "--contexts", "7,40",
                 "--shape", "8,1,128", "--repeats", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 7), (1, 40), (3, 7), (3, 40)]
    for r in rows:
        assert r["kind"] == "decode_attention"
        assert r["pytorch_us"] > 0 and r["operators_us"] > 0 and r["read_us"] > 0
        # the pool holds the contexts' whole blocks of 16, K and V, bf16
        blocks = r["batch"] * -(-r["context"] // 16)
        assert r["kv_mb"] == pytest.approx(2 * blocks * 16 * 128 * 2 / 1e6)
        # the ratios are printed to 3 decimals
        assert r["of_read"] == pytest.approx(r["read_us"] / r["operators_us"], abs=6e-4)
        assert r["speedup"] == pytest.approx(r["pytorch_us"] / r["operators_us"], abs=6e-4)
