"""Decode steps replayed from graphs per batch-size bucket, with the paged Triton decode
kernel. On a CPU the kernel runs in Triton's interpreter and a graph is a stand-in that runs
the captured forward again at each replay: what is checked here is the bucketing, the padding
rows, the static buffers and the kernel's numbers; capture itself needs the `gpu` tests."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import pytest
import torch

from pdserve.common.model_config import ModelConfig
from pdserve.common.sampling_params import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine import decode_path
from pdserve.engine.decode_graphs import applies, bucket_for, graph_buckets
from pdserve.engine.engine import Engine
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model import triton_paged
from pdserve.engine.model.attention import PagedKernels

pytest.importorskip("triton", reason="the paged decode kernel is written in Triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: Triton's interpreter


def test_buckets_cover_every_batch_with_at_most_seven_rows_of_padding_above_eight() -> None:
    assert graph_buckets(1) == (1,)
    assert graph_buckets(6) == (1, 2, 4, 6)
    assert graph_buckets(20) == (1, 2, 4, 8, 16, 20)
    buckets = graph_buckets(64)
    assert buckets == (1, 2, 4, *range(8, 65, 8))
    for batch in range(1, 65):
        bucket = bucket_for(batch, buckets)
        assert bucket >= batch and (bucket - batch < 8 if batch > 8 else bucket < 2 * batch)
    assert bucket_for(65, buckets) is None
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        graph_buckets(0)


def test_graphs_apply_to_dense_models_on_one_gpu_only(tiny_model) -> None:
    dense = ModelConfig.from_folder(tiny_model("llama"))
    assert applies(dense, "cuda", 1)
    assert not applies(dense, "cpu", 1)
    assert not applies(dense, "cuda", 2)
    for arch in ("qwen3_moe", "deepseek_v3"):  # host-sized expert batches; latent attention
        assert not applies(ModelConfig.from_folder(tiny_model(arch)), "cuda", 1)


def _replaying(replays: dict[int, int]) -> Callable:
    """A stand-in for CUDA graph capture: each replay runs the forward again, over the same
    static buffers, and writes its result into the output the capture returned. `replays`
    counts them per bucket."""

    def capture(forward):
        out = forward()
        replays[out.shape[0]] = 0

        def replay() -> None:
            with torch.inference_mode():
                out.copy_(forward())
            replays[out.shape[0]] += 1

        return replay, out

    return capture


PROMPTS = [[5 + i] * (3 + 11 * i) for i in range(7)]  # 3 to 69 tokens: 1 to 5 blocks


def _generate(engine: Engine, prompts: list[list[int]], max_tokens: int,
              stagger: bool) -> dict[str, list[int]]:
    """Greedy tokens of each prompt; with `stagger`, a prompt joins every other step, so the
    decode batch passes through sizes 1..len(prompts) (and the buckets above them)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    waiting = list(enumerate(prompts))
    tokens: dict[str, list[int]] = {}
    steps = 0
    while waiting or engine.has_unfinished_requests():
        if waiting and (not stagger or steps % 2 == 0):
            i, prompt = waiting.pop(0)
            engine.add_request(prompt, params, request_id=f"r{i}")
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        steps += 1
    return tokens


@pytest.mark.parametrize(("arch", "max_seqs", "buckets", "prompts", "tokens"), [
    ("llama", 6, (1, 2, 4, 6), 7, 16),
    ("qwen3", 4, (1, 2, 4), 5, 8),  # q/k norms in the captured forward
])
def test_graph_replays_give_the_eager_steps_tokens_and_return_every_block(
        tiny_model, arch, max_seqs, buckets, prompts, tokens) -> None:
    config = EngineConfig(model=str(tiny_model(arch)), dtype="float32", max_model_len=128,
                          num_kv_blocks=64, max_num_seqs=max_seqs, block_size=16,
                          device=DEVICE)
    eager = _generate(Engine(dataclasses.replace(config, enforce_eager=True)),
                      PROMPTS[:prompts], tokens, stagger=True)
    replays: dict[int, int] = {}
    graphed = Engine(config, graph_capture=_replaying(replays))
    assert graphed.runner.graphs.buckets == buckets
    assert tuple(sorted(replays)) == buckets
    # the pool's last block pads the buckets: the block manager never hands it out
    assert graphed.block_manager.num_blocks == graphed.kv_cache.num_blocks - 1 == 63
    assert _generate(graphed, PROMPTS[:prompts], tokens, stagger=True) == eager
    # the batch grew one prompt every other step, up to max_seqs: every bucket replayed
    assert all(n > 0 for n in replays.values()), replays
    assert graphed.block_manager.num_used_blocks == 0


def test_a_gpu_engine_whose_kernel_fails_its_check_runs_sdpa_without_graphs(
        monkeypatch, caplog, tiny_model) -> None:
    config = EngineConfig(model=str(tiny_model("llama")), dtype="float32", device="cuda")
    monkeypatch.setattr(triton_paged, "self_check", lambda device, dtype: None)
    assert decode_path.paged_kernels(config, torch.float32, None) is triton_paged.KERNELS

    def broken(device, dtype) -> None:
        raise RuntimeError("its output differs from PyTorch's by 1")

    monkeypatch.setattr(triton_paged, "self_check", broken)
    with caplog.at_level(logging.WARNING, logger=decode_path.log.name):
        assert decode_path.paged_kernels(config, torch.float32, None) is None
    assert "failed its check on cuda (its output differs" in caplog.text
    cache = KVCache(ModelConfig.from_folder(tiny_model("llama")), 8, 16, torch.float32)
    assert decode_path.graph_capture(config, ModelConfig.from_folder(tiny_model("llama")),
                                     cache, None) is None


def test_enforce_eager_or_a_moe_model_captures_no_graphs(tiny_model) -> None:
    kernels = triton_paged.KERNELS
    for arch, eager in (("llama", True), ("qwen3_moe", False)):
        path = tiny_model(arch)
        config = EngineConfig(model=str(path), dtype="float32", device="cuda",
                              enforce_eager=eager)
        model = ModelConfig.from_folder(path)
        cache = KVCache(model, 8, 16, torch.float32)
        assert decode_path.graph_capture(config, model, cache, kernels) is None


@pytest.mark.parametrize("chunked", [False, True])
def test_prompts_over_a_prefix_in_the_pool_read_it_through_the_prefill_kernel(
        monkeypatch, tiny_model, chunked) -> None:
    """A prefix-cache hit, or a prompt's later chunks, attend to K/V already in the pool: the
    Triton prefill kernel reads it in place and gives SDPA's (gathered) greedy tokens."""
    calls = {"prefill": 0}

    def counted(*args):
        calls["prefill"] += 1
        return triton_paged.prefill_attention(*args)

    monkeypatch.setattr(triton_paged, "KERNELS",
                        PagedKernels(triton_paged.decode_attention, counted))
    extra = {"enable_chunked_prefill": True, "max_num_batched_tokens": 24} if chunked else {}
    config = EngineConfig(model=str(tiny_model("llama")), dtype="float32", max_model_len=128,
                          num_kv_blocks=64, max_num_seqs=4, device=DEVICE, **extra)
    shared = list(range(40, 80))  # 40 tokens: 2 whole blocks cached after the first prompt
    prompts = [shared + [5, 6], shared + [7, 8, 9], shared[:35] + [3]]
    eager = _generate(Engine(dataclasses.replace(config, enforce_eager=True)), prompts, 8,
                      stagger=False)
    graphed = Engine(config, graph_capture=_replaying({}))
    assert _generate(graphed, prompts[:1], 8, stagger=False) == {"r0": eager["r0"]}
    # one call per layer (2) for each prompt part after K/V in the pool: the 42-token
    # prompt's 2nd chunk; both later prompts, whose first 32 tokens are cached
    assert calls["prefill"] == (2 if chunked else 0)
    tokens = _generate(graphed, prompts[1:], 8, stagger=False)
    assert calls["prefill"] == (2 if chunked else 0) + 4
    assert tokens == {"r0": eager["r1"], "r1": eager["r2"]}
    assert graphed.block_manager.num_used_blocks == 0
