"""KV bytes per token and per request, TP splitting and wire time."""

from __future__ import annotations

import math

import pytest

from pdserve.planner.kv_math import (
    breakeven_link_gbps,
    dtype_bytes,
    kv_bytes,
    kv_bytes_per_token,
    kv_bytes_per_token_per_rank,
    kv_heads_per_rank,
    transfer_seconds,
)
from pdserve.planner.model_shape import PRESETS, load_model_shape

LLAMA_70B = load_model_shape("llama-3.1-70b")
DEEPSEEK_V3 = load_model_shape("deepseek-v3")


def test_published_llama_3_1_70b_figure():
    per_token = kv_bytes_per_token(LLAMA_70B, "bf16")
    assert per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    nbytes = kv_bytes(per_token, 32_768)
    assert nbytes == 10_737_418_240
    assert round(transfer_seconds(nbytes, 100), 3) == 0.859
    assert transfer_seconds(nbytes, 100) == nbytes * 8 / 100e9


def test_published_deepseek_v3_figure():
    per_token = kv_bytes_per_token(DEEPSEEK_V3, "fp8")
    assert per_token == 61 * (512 + 64) * 1 == 35_136
    nbytes = kv_bytes(per_token, 32_768)
    assert nbytes == 1_151_336_448
    assert round(transfer_seconds(nbytes, 100), 3) == 0.092


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "deepseek-v3"])
def test_gqa_formula_for_every_gqa_preset(name):
    shape = load_model_shape(name)
    expected = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
    assert kv_bytes_per_token(shape, "bf16") == expected


def test_mla_stores_one_latent_not_k_and_v_per_head():
    # 128 heads of K and V at 192/128 dims would be hundreds of times larger.
    assert DEEPSEEK_V3.kv_values_per_token_per_layer == 512 + 64
    assert kv_bytes_per_token(DEEPSEEK_V3, "bf16") == 61 * 576 * 2


@pytest.mark.parametrize(("dtype", "nbytes"), [("bf16", 2), ("fp16", 2), ("fp8", 1), ("fp32", 4)])
def test_dtype_scales_bytes(dtype, nbytes):
    assert dtype_bytes(dtype) == nbytes
    assert kv_bytes_per_token(LLAMA_70B, dtype) == 2 * 80 * 8 * 128 * nbytes


@pytest.mark.parametrize("dtype", ["int4", "bfloat16", "", "FP8"])
def test_unknown_kv_dtype_names_the_field(dtype):
    with pytest.raises(ValueError, match=r"kv_dtype must be one of bf16, fp16, fp8, fp32"):
        kv_bytes_per_token(LLAMA_70B, dtype)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_gqa_heads_split_across_ranks(tp):
    total = kv_bytes_per_token(LLAMA_70B, "bf16")
    assert kv_bytes_per_token_per_rank(LLAMA_70B, "bf16", tp) * tp == total


def test_gqa_heads_replicate_when_tp_exceeds_them():
    assert kv_heads_per_rank(8, 16) == 1
    assert kv_heads_per_rank(8, 32) == 1
    assert (kv_bytes_per_token_per_rank(LLAMA_70B, "bf16", 16)
            == kv_bytes_per_token_per_rank(LLAMA_70B, "bf16", 8))


@pytest.mark.parametrize("tp", [3, 5, 12])
def test_uneven_head_split_is_refused(tp):
    with pytest.raises(ValueError, match=rf"tp \(--tp\) {tp} cannot split 8 KV heads evenly"):
        kv_bytes_per_token_per_rank(LLAMA_70B, "bf16", tp)


@pytest.mark.parametrize("tp", [1, 2, 8, 16])
def test_mla_latent_is_replicated_on_every_rank(tp):
    assert (kv_bytes_per_token_per_rank(DEEPSEEK_V3, "fp8", tp)
            == kv_bytes_per_token(DEEPSEEK_V3, "fp8"))


@pytest.mark.parametrize("tp", [0, -1, 1.5, True, None])
def test_bad_tp_names_the_field(tp):
    with pytest.raises(ValueError, match=r"tp \(--tp\) must be a positive integer"):
        kv_bytes_per_token_per_rank(LLAMA_70B, "bf16", tp)
    with pytest.raises(ValueError, match=r"tp \(--tp\) must be a positive integer"):
        kv_bytes_per_token_per_rank(DEEPSEEK_V3, "bf16", tp)


def test_transfer_time_is_linear_in_bytes_and_inverse_in_link():
    assert transfer_seconds(2_000, 8) == 2 * transfer_seconds(1_000, 8)
    assert transfer_seconds(1_000, 16) == transfer_seconds(1_000, 8) / 2
    assert transfer_seconds(125_000_000, 1) == 1.0  # 1 Gb/s moves 125 MB a second


@pytest.mark.parametrize("link", [0, -1, -0.5, math.nan, math.inf, True, "100"])
def test_bad_link_speed_names_the_field(link):
    with pytest.raises(ValueError, match=r"link_gbps \(--link-gbps\) must be a positive"):
        transfer_seconds(1_000, link)


def test_breakeven_link_moves_the_bytes_in_the_given_time():
    link = breakeven_link_gbps(10_737_418_240, 2.0)
    assert transfer_seconds(10_737_418_240, link) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="seconds must be positive"):
        breakeven_link_gbps(1, 0)
