"""Whole prompts (no chunking) share a step only while their prompt tokens stay within
PROMPT_PACK_TOKENS: short prompts are packed, long ones each get their own step (a longer one
than the limit still runs, alone), so the first of a burst of long prompts gets its first token
after its own prefill, not after all of them; the tokens are those of each prompt alone."""

from __future__ import annotations

from pdserve.common.engine_options import PROMPT_PACK_TOKENS
from pdserve.common.sampling_params import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from tests.conftest import KV_BLOCKS

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def _engine(path) -> Engine:
    return Engine(EngineConfig(model=str(path), dtype="float32", max_model_len=4096,
                               num_kv_blocks=KV_BLOCKS))


def _model(tiny_model):
    return tiny_model(max_position_embeddings=4096)  # a step budget (max_model_len) past 2,048


def _prompt_steps(engine: Engine, lengths: list[int]) -> tuple[list[int], dict[str, int]]:
    """The prompt tokens of each step, and each request's token."""
    for i, n in enumerate(lengths):
        engine.add_request([(n + i * 31 + t * 7) % 400 + 5 for t in range(n)], ONE,
                           request_id=f"r{i}")
    steps, tokens = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids[0]
        steps.append(engine.take_step_stats().prefill_tokens)
    return steps, tokens


def test_short_prompts_share_a_step_long_ones_do_not(tiny_model) -> None:
    assert PROMPT_PACK_TOKENS == 2048  # the lengths below straddle it
    path = _model(tiny_model)
    short, _ = _prompt_steps(_engine(path), [300, 300, 300, 300])
    assert short == [1200]
    long, _ = _prompt_steps(_engine(path), [900, 900, 900, 100])
    assert long == [1800, 1000]  # a third 900 would make 2,700: it waits for the next step
    alone, _ = _prompt_steps(_engine(path), [3000, 100])
    assert alone == [3000, 100]  # longer than the limit: it runs, alone


def test_packing_does_not_change_tokens(tiny_model) -> None:
    path = _model(tiny_model)
    _, packed = _prompt_steps(_engine(path), [900, 900, 900])
    alone = {f"r{i}": _prompt_steps(_engine(path), [900] * (i + 1))[1][f"r{i}"]
             for i in range(3)}
    assert packed == alone
