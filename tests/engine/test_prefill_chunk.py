"""The prefill chunk (`Engine.set_prefill_chunk`): while a request decodes, a step computes at
most that many prompt tokens, so a long prompt goes in chunks beside the stream and the stream
gets a token every step; with nothing decoding the prompt goes whole; the tokens are the ones
of an engine without the cap."""

from __future__ import annotations

import time

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from tests.conftest import KV_BLOCKS

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
LONG_PROMPT = [(t * 13) % 480 + 5 for t in range(150)]
SHORT_PROMPT = list(range(5, 25))


def _engine(path) -> Engine:
    return Engine(EngineConfig(model=str(path), dtype="float32", max_model_len=512,
                               num_kv_blocks=KV_BLOCKS))


def _run(engine: Engine, chunk: int | None) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """Every request's tokens, and each step's (prompt tokens, decode tokens)."""
    engine.set_prefill_chunk(chunk)
    stream = engine.add_request(SHORT_PROMPT, GREEDY, request_id="stream")
    engine.step()  # the stream's prompt, whole: nothing decodes yet
    engine.add_request(LONG_PROMPT, GREEDY, request_id="long")
    tokens, steps = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        stats = engine.take_step_stats()
        if stats is not None:
            steps.append((stats.prefill_tokens, stats.decode_tokens))
    assert stream in tokens
    return tokens, steps


def test_a_long_prompt_goes_in_chunks_beside_a_stream_with_the_same_tokens(tiny_model) -> None:
    whole_tokens, whole_steps = _run(_engine(tiny_model()), None)
    chunked_tokens, chunked_steps = _run(_engine(tiny_model()), 32)
    assert chunked_tokens == whole_tokens
    assert max(p for p, _ in whole_steps) == len(LONG_PROMPT)  # one step froze the stream
    prompt_steps = [(p, d) for p, d in chunked_steps if p]
    assert [p for p, _ in prompt_steps] == [32, 32, 32, 32, 22]  # 150 tokens, 32 a step
    assert all(d >= 1 for _, d in prompt_steps)  # the stream decoded in every one of them


def test_with_nothing_decoding_the_prompt_goes_whole(tiny_model) -> None:
    engine = _engine(tiny_model())
    engine.set_prefill_chunk(16)
    engine.add_request(LONG_PROMPT, GREEDY)
    engine.step()
    assert engine.take_step_stats().prefill_tokens == len(LONG_PROMPT)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_a_chunk_is_a_positive_int_or_none(tiny_model, bad) -> None:
    with pytest.raises(ValueError, match="a prefill chunk is an int >= 1 tokens or None"):
        _engine(tiny_model()).set_prefill_chunk(bad)


def test_the_chunk_site_is_the_streams_and_what_the_next_chunk_attends_to_beyond_itself(
        tiny_model) -> None:
    """The requests decoding, and the running prompt's computed tokens, or with none the
    waiting head's cached prefix."""
    engine = _engine(tiny_model())
    assert engine.chunk_site() == (0, 0)
    engine.set_prefill_chunk(32)
    engine.add_request(SHORT_PROMPT, GREEDY, request_id="stream")
    engine.step()
    engine.add_request(LONG_PROMPT, GREEDY, request_id="long")
    assert engine.chunk_site() == (1, 0)  # nothing of it computed or cached
    engine.step()
    assert engine.chunk_site() == (1, 32)
    engine.step()
    assert engine.chunk_site() == (1, 64)
    while engine.scheduler.running[-1].computing_prompt:
        engine.step()
    assert engine.chunk_site() == (2, 0)  # no prompt left: both decode
    engine.add_request(LONG_PROMPT + [7, 8], GREEDY, request_id="again")
    block = engine.config.block_size
    assert engine.chunk_site() == (2, len(LONG_PROMPT) // block * block)  # cached prefix


def test_the_prompt_queue_lists_the_prompts_waiting_for_a_first_token_oldest_first(
        tiny_model) -> None:
    """Each with its arrival and the prompt tokens left up to and including its own: what the
    worker's TTFT check counts (`common/step_cost.misses_ttft`)."""
    engine = _engine(tiny_model())
    engine.set_prefill_chunk(32)
    engine.add_request(SHORT_PROMPT, GREEDY, request_id="stream")
    engine.step()
    engine.add_request(LONG_PROMPT, GREEDY, request_id="long")
    engine.step()  # 32 of its 150 tokens
    before = time.monotonic()
    engine.add_request(SHORT_PROMPT + [3], GREEDY, request_id="short", waited_s=1.5)
    arrivals = [engine.requests[r].arrival_time for r in ("long", "short")]
    assert engine.prompt_queue() == ((arrivals[0], 118), (arrivals[1], 118 + 21))
    assert before - 1.5 <= arrivals[1] <= time.monotonic() - 1.5  # it waited at the router
    with pytest.raises(ValueError, match="waited_s must be a finite number of seconds >= 0"):
        engine.add_request(SHORT_PROMPT, GREEDY, waited_s=-1.0)
