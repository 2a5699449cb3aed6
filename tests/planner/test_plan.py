"""The planner end to end: presets and config files, plans, verdicts, the CLI and bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pdserve.planner.cost import Efficiency
from pdserve.planner.hardware import HARDWARE, Hardware, get_hardware
from pdserve.planner.model_shape import (
    PRESETS,
    AttentionKind,
    ModelShape,
    MoEShape,
    load_model_shape,
)
from pdserve.planner.plan import Verdict, Workload, make_plan, plan_to_dict, render_text
from tests.planner.cli_run import run_pdserve

H100 = get_hardware("H100")
REQUIRED_JSON_KEYS = {"kv_bytes_per_token", "kv_bytes", "transfer_seconds", "prefill_seconds",
                      "decode_step_seconds", "prefill_decode_ratio", "verdict", "reason"}


def plan(model: str = "llama-3.1-70b", prompt: int = 32_768, output: int = 256,
         link: float = 100, **kw):
    gpu = kw.pop("gpu", "H100")
    return make_plan(load_model_shape(model), get_hardware(gpu),
                     Workload(prompt_tokens=prompt, output_tokens=output, link_gbps=link, **kw))


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    return run_pdserve(["plan", *argv], capsys)


# ---- published figures ------------------------------------------------------------------------


def test_llama_70b_published_figures_through_the_plan():
    p = plan()
    assert p.kv_bytes == 10_737_418_240
    assert round(p.transfer_seconds, 3) == 0.859


def test_deepseek_v3_published_figures_through_the_plan():
    p = plan("deepseek-v3", kv_dtype="fp8")
    assert p.kv_bytes == 1_151_336_448
    assert round(p.transfer_seconds, 3) == 0.092


def test_published_figures_through_the_cli_json(capsys):
    base = ["--prompt-tokens", "32768", "--output-tokens", "256", "--link-gbps", "100", "--json"]
    rc, out, _ = run_cli(["--model", "llama-3.1-70b", *base], capsys)
    got = json.loads(out)
    assert rc == 0 and got["kv_bytes"] == 10_737_418_240
    assert round(got["transfer_seconds"], 3) == 0.859
    rc, out, _ = run_cli(["--model", "deepseek-v3", "--kv-dtype", "fp8", *base], capsys)
    got = json.loads(out)
    assert rc == 0 and got["kv_bytes"] == 1_151_336_448
    assert round(got["transfer_seconds"], 3) == 0.092


def test_text_output_shows_the_published_figures(capsys):
    rc, out, _ = run_cli(["--model", "llama-3.1-70b", "--prompt-tokens", "32768",
                          "--output-tokens", "256", "--link-gbps", "100"], capsys)
    assert rc == 0
    assert "10,737,418,240 B" in out and "0.859 s over 100 Gb/s" in out
    assert "DISAGGREGATE" in out


# ---- model shapes -----------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "total", "active"), [
    ("llama-3.1-8b", 8.03e9, 8.03e9),
    ("llama-3.1-70b", 70.6e9, 70.6e9),
    ("qwen2.5-72b", 72.7e9, 72.7e9),
    ("deepseek-v3", 671e9, 37e9),
    ("smollm2-135m", 134.5e6, 134.5e6),
])
def test_presets_match_the_published_parameter_counts(name, total, active):
    shape = load_model_shape(name)
    assert shape.params_total == pytest.approx(total, rel=0.005)
    assert shape.params_active == pytest.approx(active, rel=0.02)


def test_gqa_and_mla_presets():
    assert load_model_shape("llama-3.1-70b").attention is AttentionKind.GQA
    ds = load_model_shape("deepseek-v3")
    assert ds.attention is AttentionKind.MLA and ds.is_mla
    assert (ds.kv_lora_rank, ds.qk_rope_head_dim, ds.num_layers) == (512, 64, 61)
    assert ds.weight_dtype == "fp8" and ds.moe is not None and ds.moe.moe_layers == 58
    assert load_model_shape("LLaMA-3.1-8B").name == "llama-3.1-8b"  # any case


def test_moe_experts_touched_grows_from_k_to_all():
    moe = load_model_shape("deepseek-v3").moe
    assert moe.experts_touched(1) == pytest.approx(8)
    assert moe.experts_touched(10_000) == pytest.approx(256)
    assert moe.experts_touched(64) < moe.experts_touched(128) < 256


def _llama_70b_config() -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "num_hidden_layers": 80, "hidden_size": 8192, "intermediate_size": 28672,
            "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
            "rope_theta": 500000.0, "torch_dtype": "bfloat16"}


def _deepseek_config() -> dict:
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            **PRESETS["deepseek-v3"], "num_nextn_predict_layers": 1, "n_group": 8}


def _write(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_gqa_config_json_from_a_file_and_a_folder(tmp_path):
    path = _write(tmp_path, _llama_70b_config())  # no head_dim: hidden / heads = 128
    for source in (str(path), str(tmp_path)):
        p = make_plan(load_model_shape(source), H100, Workload(32_768, 256, 100))
        assert p.model.attention is AttentionKind.GQA
        assert p.kv_bytes == 10_737_418_240
        assert p.model.params_total == load_model_shape("llama-3.1-70b").params_total


def test_gqa_config_defaults_kv_heads_to_heads(tmp_path):
    cfg = _llama_70b_config()
    del cfg["num_key_value_heads"]  # MHA, as transformers' LlamaConfig defaults it
    shape = load_model_shape(str(_write(tmp_path, cfg)))
    assert shape.num_kv_heads == 64


def test_mla_config_json_from_a_file(tmp_path):
    shape = load_model_shape(str(_write(tmp_path, _deepseek_config())))
    assert shape.attention is AttentionKind.MLA
    p = make_plan(shape, H100, Workload(32_768, 256, 100, kv_dtype="fp8"))
    assert p.kv_bytes == 1_151_336_448


def test_mixtral_style_moe_config(tmp_path):
    cfg = {"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096,
           "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
           "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2}
    shape = load_model_shape(str(_write(tmp_path, cfg)))
    assert shape.params_total == pytest.approx(46.7e9, rel=0.005)  # Mixtral 8x7B model card
    assert shape.params_active == pytest.approx(12.9e9, rel=0.005)
    assert shape.moe.moe_layers == 32


@pytest.mark.parametrize("field", ["num_hidden_layers", "hidden_size", "num_attention_heads",
                                   "vocab_size", "intermediate_size"])
def test_gqa_config_missing_a_field_names_it(tmp_path, field):
    cfg = _llama_70b_config()
    del cfg[field]
    with pytest.raises(ValueError, match=rf"missing '{field}'"):
        load_model_shape(str(_write(tmp_path, cfg)))


@pytest.mark.parametrize("field", ["qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                   "num_experts_per_tok"])
def test_mla_config_missing_a_field_names_it(tmp_path, field):
    cfg = _deepseek_config()
    del cfg[field]
    with pytest.raises(ValueError, match=rf"missing '{field}'"):
        load_model_shape(str(_write(tmp_path, cfg)))


@pytest.mark.parametrize(("patch", "message"), [
    ({"num_hidden_layers": 0}, "'num_hidden_layers' must be a positive integer, got 0"),
    ({"hidden_size": "8192"}, "'hidden_size' must be a positive integer"),
    ({"num_key_value_heads": 7}, "must be a multiple of num_key_value_heads"),
    ({"hidden_size": 8001}, "missing 'head_dim'"),
])
def test_bad_config_values_are_named(tmp_path, patch, message):
    with pytest.raises(ValueError, match=message):
        load_model_shape(str(_write(tmp_path, {**_llama_70b_config(), **patch})))


def test_bad_config_files(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_model_shape(str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        load_model_shape(str(tmp_path / "list.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no config\.json"):
        load_model_shape(str(tmp_path / "empty"))


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match=re.escape("llama-3.1-8b, llama-3.1-70b, "
                                                   "qwen2.5-72b, deepseek-v3, smollm2-135m")):
        load_model_shape("gpt-5")


def test_shape_and_moe_dataclasses_validate():
    with pytest.raises(ValueError, match=r"experts_per_token \(9\) must not exceed"):
        MoEShape(routed_experts=8, experts_per_token=9, params_per_expert=1, moe_layers=1)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive integer"):
        ModelShape(name="m", attention=AttentionKind.GQA, num_layers=1, hidden_size=8,
                   num_heads=2, vocab_size=10, qk_head_dim=4, v_head_dim=4,
                   body_dense_params=100)
    with pytest.raises(ValueError, match="kv_lora_rank must be a positive integer"):
        ModelShape(name="m", attention="MLA", num_layers=1, hidden_size=8, num_heads=2,
                   vocab_size=10, qk_head_dim=4, v_head_dim=4, body_dense_params=100)


# ---- hardware ---------------------------------------------------------------------------------


def test_hardware_presets_have_positive_numbers_and_sources():
    for hw in HARDWARE.values():
        assert hw.bf16_flops > 0 and hw.memory_bandwidth > 0 and hw.memory_bytes > 0
        assert hw.source
    assert get_hardware("H100").bf16_flops == pytest.approx(989.5e12)
    assert get_hardware("a100").fp8_flops is None
    assert get_hardware("cpu").name == "cpu-epyc-2core"


def test_unknown_gpu_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"gpu \(--gpu\) 'TPU' is not a known device; pick one "
                                         r"of h100, h200, a100, l40s, mi300x, cpu-epyc-2core"):
        get_hardware("TPU")


def test_hardware_dataclass_validates():
    with pytest.raises(ValueError, match="memory_bandwidth must be a positive finite number"):
        Hardware("x", bf16_flops=1.0, fp8_flops=None, memory_bandwidth=0, memory_bytes=1.0,
                 source="s")


# ---- plans ------------------------------------------------------------------------------------


def test_tp_splits_gqa_work_and_kv_but_not_mla_kv():
    one, eight = plan(), plan(tp=8)
    assert eight.kv_bytes == one.kv_bytes  # the request's KV is what it is
    assert eight.kv_bytes_per_gpu * 8 == one.kv_bytes_per_gpu
    assert eight.transfer_seconds == pytest.approx(one.transfer_seconds / 8)
    assert eight.prefill.flops == pytest.approx(one.prefill.flops / 8)
    ds1, ds8 = plan("deepseek-v3", kv_dtype="fp8"), plan("deepseek-v3", kv_dtype="fp8", tp=8)
    assert ds8.kv_bytes_per_gpu == ds1.kv_bytes_per_gpu
    assert ds8.transfer_seconds == ds1.transfer_seconds
    assert any("replicated on every TP rank" in n for n in ds8.notes)


def test_prefill_roofline_formula():
    p = plan(tp=8)
    s = p.model
    tokens = 32_768
    attention = 2 * tokens * (tokens + 1) / 2 * 64 * (128 + 128) * 80
    flops = 2 * s.body_active_params * tokens + 2 * s.lm_head_params + attention
    assert p.prefill.flops == pytest.approx(flops / 8)
    assert p.prefill.bound == "compute"
    assert p.prefill_seconds == pytest.approx(flops / 8 / (989.5e12 * 0.5))


def test_decode_step_reads_weights_and_kv():
    p = plan(tp=8, decode_batch=16)
    s = p.model
    weights = (s.body_dense_params + s.lm_head_params) * 2 / 8
    kv = 16 * (32_768 + 256 / 2) * p.kv_bytes_per_token_per_gpu
    assert p.decode.bytes == pytest.approx(weights + kv)
    assert p.decode.bound == "memory"
    assert p.decode_step_seconds == pytest.approx((weights + kv) / (3.35e12 * 0.8))


def test_ratio_is_prefill_over_decode_worker_seconds():
    p = plan(tp=8)
    decode = 255 * p.decode_step_seconds / p.decode_batch
    assert p.prefill_decode_ratio == pytest.approx(p.prefill_seconds / decode)


def test_default_decode_batch_fits_memory():
    p = plan(tp=8)
    free = 80e9 * 0.9 - p.model.params_total * 2 / 8
    per_request = p.kv_bytes_per_token_per_gpu * (32_768 + 256)
    assert p.decode_batch == int(free // per_request)
    assert 1 <= plan("smollm2-135m", prompt=128).decode_batch == 256


def test_weights_that_do_not_fit_are_flagged():
    p = plan()  # 141 GB of bf16 weights on one 80 GB H100
    assert any("use --tp 2 or more" in n for n in p.notes)
    assert p.decode_batch == 1
    ds = plan("deepseek-v3", kv_dtype="fp8")  # 671 GB of fp8: 10 GPUs, rounded up to 16
    assert any("use --tp 16 or more" in n for n in ds.notes)
    assert not [n for n in plan(tp=8).notes if "weights need" in n]


def test_fp8_weights_on_a_gpu_without_fp8_use_the_bf16_peak():
    p = plan("deepseek-v3", kv_dtype="fp8", tp=16, gpu="A100")
    assert any("no fp8 tensor cores" in n for n in p.notes)


def test_mfu_scales_compute_bound_prefill():
    slow = plan(tp=8, efficiency=Efficiency(mfu=0.25))
    assert slow.prefill_seconds == pytest.approx(2 * plan(tp=8).prefill_seconds)


def test_json_has_the_required_keys(capsys):
    rc, out, _ = run_cli(["--model", "deepseek-v3", "--prompt-tokens", "4096",
                          "--output-tokens", "512", "--link-gbps", "200", "--tp", "8",
                          "--gpu", "h200", "--json"], capsys)
    got = json.loads(out)
    assert rc == 0 and got.keys() >= REQUIRED_JSON_KEYS
    assert got["verdict"] in {v.value for v in Verdict}
    assert isinstance(got["kv_bytes"], int) and isinstance(got["kv_bytes_per_token"], int)
    assert got == json.loads(json.dumps(plan_to_dict(plan(
        "deepseek-v3", prompt=4096, output=512, link=200, tp=8, gpu="h200"))))


# ---- verdicts ---------------------------------------------------------------------------------

ORDER = {Verdict.COLLOCATE: 0, Verdict.MARGINAL: 1, Verdict.DISAGGREGATE: 2}


def test_verdict_flips_as_the_link_slows():
    verdicts = [plan(tp=8, link=link).verdict for link in (400, 100, 10, 1)]
    assert verdicts == [Verdict.DISAGGREGATE, Verdict.DISAGGREGATE, Verdict.MARGINAL,
                        Verdict.COLLOCATE]
    slow = plan(tp=8, link=1)
    assert "longer than" in slow.reason and "1 Gb/s" in slow.reason


def test_verdict_flips_as_the_prompt_grows():
    verdicts = [plan(tp=8, prompt=n).verdict for n in (128, 1024, 8192, 32_768)]
    assert verdicts == [Verdict.COLLOCATE, Verdict.MARGINAL, Verdict.DISAGGREGATE,
                        Verdict.DISAGGREGATE]
    assert "under one decode step" in plan(tp=8, prompt=128).reason
    ranks = [ORDER[plan(tp=8, prompt=n, link=25).verdict] for n in (128, 512, 4096, 131_000)]
    assert ranks == sorted(ranks)


def test_a_single_output_token_has_no_decode_to_protect(capsys):
    p = plan(output=1, tp=8)
    assert p.verdict is Verdict.COLLOCATE and p.prefill_decode_ratio is None
    rc, out, _ = run_cli(["--model", "llama-3.1-8b", "--prompt-tokens", "100",
                          "--output-tokens", "1", "--link-gbps", "100", "--json"], capsys)
    assert rc == 0 and json.loads(out)["prefill_decode_ratio"] is None


def test_render_text_names_every_figure():
    text = render_text(plan("deepseek-v3", kv_dtype="fp8", tp=8))
    for label in ("KV per token", "KV per request", "transfer", "prefill", "decode step",
                  "P:D ratio", "verdict", "MLA"):
        assert label in text


# ---- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "gpt-5"], "model (--model) 'gpt-5' is neither a preset (llama-3.1-8b,"),
    (["--prompt-tokens", "0"], "prompt_tokens (--prompt-tokens) must be a positive integer"),
    (["--prompt-tokens", "-5"], "prompt_tokens (--prompt-tokens) must be a positive integer"),
    (["--output-tokens", "0"], "output_tokens (--output-tokens) must be a positive integer"),
    (["--link-gbps", "0"], "link_gbps (--link-gbps) must be a positive"),
    (["--link-gbps", "-100"], "link_gbps (--link-gbps) must be a positive"),
    (["--link-gbps", "nan"], "link_gbps (--link-gbps) must be a positive"),
    (["--tp", "0"], "tp (--tp) must be a positive integer"),
    (["--tp", "-2"], "tp (--tp) must be a positive integer"),
    (["--tp", "3"], "tp (--tp) 3 cannot split 8 KV heads evenly"),
    (["--gpu", "TPUv5"], "gpu (--gpu) 'TPUv5' is not a known device; pick one of h100,"),
    (["--kv-dtype", "int8"], "kv_dtype (--kv-dtype) must be one of bf16, fp16, fp8, fp32"),
    (["--weight-dtype", "int4"], "weight_dtype (--weight-dtype) must be one of bf16,"),
    (["--mfu", "0"], "mfu (--mfu) must be a fraction in (0, 1]"),
    (["--mbu", "1.5"], "mbu (--mbu) must be a fraction in (0, 1]"),
    (["--decode-batch", "0"], "decode_batch (--decode-batch) must be a positive integer"),
])
def test_bad_cli_input_prints_an_error_and_exits_2(capsys, args, message):
    base = {"--model": "llama-3.1-70b", "--prompt-tokens": "1024", "--output-tokens": "64",
            "--link-gbps": "100"}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    rc, out, err = run_cli([x for kv in base.items() for x in kv], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("pdserve: error: ") and message in err
    assert "Traceback" not in err


def test_bad_config_through_the_cli(tmp_path, capsys):
    cfg = _deepseek_config()
    del cfg["kv_lora_rank"]  # no longer MLA, and a GQA reading needs more than this has
    cfg["num_key_value_heads"] = 7
    rc, _, err = run_cli(["--model", str(_write(tmp_path, cfg)), "--prompt-tokens", "10",
                          "--output-tokens", "10", "--link-gbps", "10"], capsys)
    assert rc == 2 and err.startswith("pdserve: error: ") and "num_key_value_heads" in err


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prompt_tokens": 0}, "prompt_tokens"),
    ({"output_tokens": -1}, "output_tokens"),
    ({"prompt_tokens": 1.5}, "prompt_tokens"),
    ({"link_gbps": 0}, "link_gbps"),
    ({"tp": 0}, "tp"),
    ({"kv_dtype": "int4"}, "kv_dtype"),
    ({"decode_batch": 0}, "decode_batch"),
])
def test_workload_validates_every_field(kwargs, message):
    fields = {"prompt_tokens": 10, "output_tokens": 10, "link_gbps": 100.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        Workload(**fields)
