"""Bad input raises ValueError saying what to fix, and leaves the engine usable."""

from __future__ import annotations

import json

import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(model=str(tiny_model("llama")), dtype="float32", max_model_len=64)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "prompt is empty"),
        ([], "non-empty list"),
        ([[]], "prompt is empty"),
        ([list(range(4, 68))], "context is 64"),
        ([[1, 2, 10**6]], "ints in [0, "),
        ([[1, -3]], "ints in [0, "),
        ([[1, 2.5]], "ints in [0, "),
        ([3.5], "each prompt must be a str or a list"),
        (None, "prompts must be"),
    ],
)
def test_bad_prompts_raise_and_leak_nothing(llm, prompt, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.block_manager.num_used_blocks == 0
    assert not llm.engine.requests


def test_a_bad_prompt_in_a_batch_runs_none_of_it(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[5, 6, 7], ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.requests
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_output_stops_at_the_context_length(llm):
    out = llm.generate([list(range(4, 60))], SamplingParams(max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 64 - 56
    assert out.outputs[0].finish_reason == "length"


def test_mismatched_params_list(llm):
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([[5]], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_duplicate_request_id(llm):
    engine = llm.engine
    engine.add_request([5, 6], SamplingParams(max_tokens=1), request_id="same")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5, 6], SamplingParams(max_tokens=1), request_id="same")
    engine.abort("same")
    engine.step()
    assert engine.block_manager.num_used_blocks == 0


def test_remote_requests_need_the_decode_role(llm):
    with pytest.raises(ValueError, match="decode role"):
        llm.engine.add_remote_request([5, 6, 7])


def test_unknown_model_name():
    with pytest.raises(ValueError, match="smollm2"):
        LLM(model="no-such-model-anywhere")


def test_broken_model_folder(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(model=str(tmp_path))


def test_unsupported_architecture(tmp_path, tiny_model):
    src = tiny_model("llama")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(model=str(tmp_path))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float8"}, "dtype must be one of"),
        ({"block_size": 12}, "power of two"),
        ({"num_kv_blocks": 0}, "num_kv_blocks must be positive"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"device": "tpu"}, "device must be"),
        ({"role": "router"}, "router"),
    ],
)
def test_bad_engine_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_model_len": 100_000}, "exceeds the model's context"),
        ({"num_kv_blocks": 2, "max_model_len": 64}, "needs 4"),
        ({"max_num_batched_tokens": 16, "max_model_len": 64}, "enable chunked prefill"),
    ],
)
def test_settings_that_could_never_run(tiny_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=str(tiny_model("llama")), dtype="float32", **kwargs)
