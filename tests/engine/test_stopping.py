"""Stop conditions, text and logprobs, as a user of the offline API sees them."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.conftest import hf_greedy, hf_logits

PROMPT = list(range(30, 50))


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(model=str(tiny_model("llama")), dtype="float32", max_model_len=256)


def _one(llm: LLM, **params) -> object:
    return llm.generate([PROMPT], SamplingParams(temperature=0, **params), use_tqdm=False)[0]


def test_text_is_the_decoded_tokens(llm):
    out = _one(llm, max_tokens=40, ignore_eos=True).outputs[0]
    assert out.text == llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)


def test_max_tokens(llm):
    out = _one(llm, max_tokens=7, ignore_eos=True).outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(llm, include):
    full = _one(llm, max_tokens=40, ignore_eos=True).outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), "pick a visible stop string"
    out = _one(llm, max_tokens=40, ignore_eos=True, stop=[stop],
               include_stop_str_in_output=include).outputs[0]
    cut = full.index(stop) + (len(stop) if include else 0)
    assert out.text == full[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 40
    assert llm.engine.block_manager.num_used_blocks == 0


def test_stop_token_id(llm):
    full = _one(llm, max_tokens=20, ignore_eos=True).outputs[0].token_ids
    out = _one(llm, max_tokens=20, ignore_eos=True, stop_token_ids=[full[5]]).outputs[0]
    assert out.token_ids == full[: full.index(full[5]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == full[5]


def test_eos_stops_unless_ignored(tiny_model):
    base = tiny_model("llama")
    eos = hf_greedy(base, PROMPT, 10)[6]
    llm = LLM(model=str(tiny_model("llama", eos_token_id=eos)), dtype="float32",
              max_model_len=256)
    stopped = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == eos
    assert stopped.stop_reason is None
    ignored = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10,
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert ignored.outputs[0].token_ids == hf_greedy(base, PROMPT, 10)


def test_logprobs_are_the_model_distribution(llm, tiny_model):
    out = _one(llm, max_tokens=6, ignore_eos=True, logprobs=3).outputs[0]
    ref = torch.log_softmax(hf_logits(tiny_model("llama"), PROMPT + out.token_ids), dim=-1)
    for i, tok in enumerate(out.token_ids):
        row = ref[len(PROMPT) - 1 + i]
        assert out.logprobs[i] == pytest.approx(row[tok].item(), abs=1e-4)
        top = out.top_logprobs[i]
        assert list(top) == row.topk(3).indices.tolist()
        assert max(top.values()) == pytest.approx(out.logprobs[i], abs=1e-6)  # greedy = top-1


def test_seeded_sampling_repeats_and_unseeded_varies(llm):
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    a, b = (llm.generate([PROMPT, PROMPT[:5]], seeded, use_tqdm=False) for _ in range(2))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    free = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    runs = {tuple(llm.generate([PROMPT], free, use_tqdm=False)[0].outputs[0].token_ids)
            for _ in range(3)}
    assert len(runs) > 1
