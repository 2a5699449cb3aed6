"""Prefill role to decode role in one process: the shape the transfer plane fills in later."""

from __future__ import annotations

from pdserve import LLM, SamplingParams
from pdserve.engine.engine import Engine
from tests.conftest import engine_pair, hf_greedy

PROMPTS = [[7], list(range(20, 77)), list(range(100, 116)), [5, 6, 7, 8, 9, 10, 11]]


def _prefill_all(pre: Engine, prompts, params) -> dict:
    ids = [pre.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    done = {}
    while len(done) < len(ids):
        for out in pre.step():
            done[out.request_id] = out
    return done


def _hand_over(pre: Engine, dec: Engine, out, params) -> None:
    rid = out.request_id
    dec.add_remote_request(out.prompt_token_ids, params, request_id=rid)
    dst = dec.reserved_blocks(rid)
    assert dst is not None and len(dst) == len(out.kv_block_ids)
    dec.kv_cache.copy_blocks_from(pre.kv_cache, out.kv_block_ids, dst)
    pre.release(rid)
    dec.kv_ready(rid, out.outputs[0].token_ids[0])


def _run(dec: Engine) -> dict:
    final = {}
    while dec.has_unfinished_requests():
        for out in dec.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_handover_greedy_matches_transformers(tiny_model):
    path = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    pre, dec = engine_pair(path)
    prefilled = _prefill_all(pre, PROMPTS, params)
    for out in prefilled.values():
        assert not out.finished and out.kv_block_ids
        assert len(out.outputs[0].token_ids) == 1
        _hand_over(pre, dec, out, params)
    assert pre.block_manager.num_used_blocks == 0
    final = _run(dec)
    for i, prompt in enumerate(PROMPTS):
        assert final[f"r{i}"].outputs[0].token_ids == hf_greedy(path, prompt, 48)
    assert dec.block_manager.num_used_blocks == 0


def test_seeded_sampling_is_the_same_across_the_handover(tiny_model):
    path = tiny_model("llama")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=32,
                            ignore_eos=True)
    collocated = LLM(model=str(path), dtype="float32", max_model_len=256)
    expected = collocated.generate(PROMPTS, params, use_tqdm=False)
    pre, dec = engine_pair(path)
    for out in _prefill_all(pre, PROMPTS, params).values():
        _hand_over(pre, dec, out, params)
    final = _run(dec)
    for i, exp in enumerate(expected):
        assert final[f"r{i}"].outputs[0].token_ids == exp.outputs[0].token_ids
        assert final[f"r{i}"].outputs[0].text == exp.outputs[0].text


def test_stop_on_token_zero_ends_after_prefill(tiny_model):
    path = tiny_model("llama")
    pre, _ = engine_pair(path)
    first = hf_greedy(path, PROMPTS[1], 1)[0]
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first])
    out = _prefill_all(pre, [PROMPTS[1]], params)["r0"]
    assert out.finished and out.outputs[0].finish_reason == "stop"
    assert out.kv_block_ids is None
    assert pre.block_manager.num_used_blocks == 0
    one = _prefill_all(pre, [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=1))["r0"]
    assert one.finished and one.outputs[0].finish_reason == "length"
    assert pre.block_manager.num_used_blocks == 0


def test_decode_reservation_waits_for_free_blocks(tiny_model):
    path = tiny_model("llama")
    pre, dec = engine_pair(path, decode_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    long_prompts = [list(range(10, 10 + 150)), list(range(300, 300 + 150))]  # 10 blocks each
    outs = _prefill_all(pre, long_prompts, params)
    _hand_over(pre, dec, outs["r0"], params)
    dec.add_remote_request(outs["r1"].prompt_token_ids, params, request_id="r1")
    assert dec.reserved_blocks("r1") is None  # 6 blocks free, 10 needed: it queues
    final = _run(dec)
    assert "r0" in final
    dec.reserve_remote()
    dst = dec.reserved_blocks("r1")
    assert dst is not None
    dec.kv_cache.copy_blocks_from(pre.kv_cache, outs["r1"].kv_block_ids, dst)
    pre.release("r1")
    dec.kv_ready("r1", outs["r1"].outputs[0].token_ids[0])
    final = _run(dec)
    assert final["r1"].outputs[0].token_ids == hf_greedy(path, long_prompts[1], 8)
    assert dec.block_manager.num_used_blocks == 0
    assert pre.block_manager.num_used_blocks == 0


def test_aborting_reserved_and_prefilled_requests_frees_both_pools(tiny_model):
    path = tiny_model("llama")
    pre, dec = engine_pair(path)
    params = SamplingParams(temperature=0, max_tokens=8)
    outs = _prefill_all(pre, PROMPTS[:2], params)
    dec.add_remote_request(outs["r0"].prompt_token_ids, params, request_id="r0")
    assert dec.block_manager.num_used_blocks > 0
    dec.abort("r0")
    pre.abort("r0")
    pre.abort("r1")
    aborted = [o for o in dec.step() + pre.step() if o.outputs[0].finish_reason == "abort"]
    assert {o.request_id for o in aborted} == {"r0", "r1"}
    assert dec.block_manager.num_used_blocks == 0
    assert pre.block_manager.num_used_blocks == 0
