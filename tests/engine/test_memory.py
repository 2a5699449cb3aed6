"""Blocks under pressure: preemption, aborts, and the pool always returning to full."""

from __future__ import annotations

import random

from pdserve import LLM, SamplingParams
from tests.conftest import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def test_preempted_requests_recompute_to_the_same_tokens(tiny_model):
    path = tiny_model("llama")
    assert_preempted_requests_keep_their_tokens(
        LLM(model=str(path), dtype="float32", max_model_len=128, num_kv_blocks=12), path)


def assert_preempted_requests_keep_their_tokens(llm: LLM, path) -> None:
    """`llm` has 12 blocks of 16 tokens; four requests of 30 + 48 tokens need 20 at the end."""
    prompts = [list(range(s, s + 30)) for s in (10, 60, 110, 160)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 48)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_any_mix_of_finished_aborted_and_preempted_frees_every_block(tiny_model):
    path = tiny_model("llama")
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, num_kv_blocks=14,
              enable_chunked_prefill=True, max_num_batched_tokens=40)
    engine = llm.engine
    rng = random.Random(0)
    ids = []
    for i in range(24):
        prompt = [rng.randrange(4, 500) for _ in range(rng.randrange(1, 60))]
        params = SamplingParams(temperature=rng.choice([0, 1.0]), seed=i,
                                max_tokens=rng.randrange(1, 50))
        ids.append(engine.add_request(prompt, params))
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps % 5 == 0:  # abort whatever is oldest and still alive: waiting or running
            alive = [r for r in ids if r in engine.requests]
            if alive:
                engine.abort(alive[0])
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
        assert engine.block_manager.num_used_blocks <= engine.block_manager.num_blocks
    assert set(finished) == set(ids)
    reasons = set(finished.values())
    assert "abort" in reasons and "length" in reasons
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.requests
