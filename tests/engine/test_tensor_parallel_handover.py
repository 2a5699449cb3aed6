"""A prefill engine at one tensor-parallel size hands its KV to a decode engine at another: the
pools of both are whole models' pools (the ranks of each share one), so the blocks move as
they move between one-process engines, and decoding gives the collocated engine's tokens."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig, Role
from pdserve.engine.engine import Engine
from pdserve.transfer.layout import KVLayout

PROMPTS = [[7], list(range(20, 77)), list(range(100, 116)), [5, 6, 7, 8, 9, 10, 11]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
COMMON = {"dtype": "float32", "max_model_len": 256}
# Llama with 2 KV heads: split, one a rank; with 1 KV head: replicated on both ranks;
# DeepSeek-V3: the latent pool, whole on every rank (MLA + MoE + a dense first layer)
MODELS = {"two_kv_heads": ("llama", {}), "one_kv_head": ("llama", {"num_key_value_heads": 1}),
          "deepseek_v3": ("deepseek_v3", {})}


def _engine(path, role: Role, tp: int) -> Engine:
    return Engine(EngineConfig(model=str(path), role=role, tensor_parallel_size=tp,
                               num_kv_blocks=64, **COMMON))


def _disaggregated(pre: Engine, dec: Engine) -> dict[str, list[int]]:
    """Each prompt prefilled on `pre`, its blocks copied into `dec`'s reservation, decoded."""
    for i, p in enumerate(PROMPTS):
        pre.add_request(p, GREEDY, request_id=f"r{i}")
    tokens: dict[str, list[int]] = {}
    while pre.has_unfinished_requests():
        for out in pre.step():
            rid = out.request_id
            dec.add_remote_request(out.prompt_token_ids, GREEDY, request_id=rid)
            dst = dec.reserved_blocks(rid)
            assert dst is not None
            dec.kv_cache.copy_blocks_from(pre.kv_cache, out.kv_block_ids, dst)
            pre.release(rid)
            dec.kv_ready(rid, out.outputs[0].token_ids[0])
    while dec.has_unfinished_requests():
        for out in dec.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return tokens


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_kv_moves_between_tensor_parallel_sizes_and_decodes_the_collocated_tokens(
        tiny_model, model, prefill_tp, decode_tp):
    arch, overrides = MODELS[model]
    path = tiny_model(arch, **overrides)
    want = [o.outputs[0].token_ids
            for o in LLM(model=str(path), **COMMON).generate(PROMPTS, GREEDY, use_tqdm=False)]
    pre, dec = _engine(path, Role.PREFILL, prefill_tp), _engine(path, Role.DECODE, decode_tp)
    try:
        KVLayout.of_cache(pre.kv_cache, "m").check_compatible(KVLayout.of_cache(dec.kv_cache, "m"))
        got = _disaggregated(pre, dec)
        assert [got[f"r{i}"] for i in range(len(PROMPTS))] == want
        assert pre.block_manager.num_used_blocks == 0
        assert dec.block_manager.num_used_blocks == 0
    finally:
        pre.close()
        dec.close()
