"""Tensor parallelism: an engine on 2 processes computes what the engine on one computes, owns
its child processes for exactly its own lifetime, fails loudly when one dies, and refuses what
it cannot split."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.cluster.up_process import free_port
from pdserve.common.model_config import ModelConfig
from pdserve.config import EngineConfig, Role
from pdserve.engine.parallel import rank_group
from pdserve.engine.parallel.cpu_split import split_cpus
from pdserve.engine.parallel.rank_group import RankFailed
from pdserve.engine.parallel.shard_plan import shard_plan

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[7], [5, 6, 7, 8, 9, 10, 11], list(range(20, 77)), list(range(100, 116))]
SHARED = list(range(40, 90))  # three full blocks for the prefix cache
# a 24-token step budget sends the long prompts through several chunks beside decodes
CHUNKED = {"dtype": "float32", "max_model_len": 256, "enable_chunked_prefill": True,
           "max_num_batched_tokens": 24}
STEP_LIMIT_S = 120  # far above a step of a tiny model: only a hang reaches it
WORKER_START_S = 180

# heads / KV heads: split (2 KV heads, one a rank), replicated (1 KV head on both ranks),
# uneven (3 KV heads: 2 on one rank, 1 on the other, as SmolLM2 splits)
SHAPES = {"split": {}, "replicated": {"num_key_value_heads": 1},
          "uneven": {"num_attention_heads": 6, "num_key_value_heads": 3}}


def _spy_logits(llm: LLM) -> list[torch.Tensor]:
    """Every step's logits (the sampled rows), in order."""
    seen: list[torch.Tensor] = []
    run = llm.engine.runner.run

    def spy(batch, on_layer=None):
        logits, sampling = run(batch, on_layer)
        seen.append(logits.clone())
        return logits, sampling

    llm.engine.runner.run = spy
    return seen


def _serve(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of PROMPTS, then of prompts sharing a cached prefix; the cached counts.
    Every block is back in the pool after each batch."""
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert llm.engine.block_manager.num_used_blocks == 0
    llm.generate([SHARED + [5, 6]], GREEDY, use_tqdm=False)
    outs = llm.generate([SHARED + [7, 8, 9], SHARED[:33]], GREEDY, use_tqdm=False)
    assert llm.engine.block_manager.num_used_blocks == 0
    return tokens + [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("shape", SHAPES)
def test_two_ranks_match_one_and_leave_no_process(tiny_model, shape):
    assert_two_ranks_match_one(tiny_model("llama", **SHAPES[shape]))


def assert_two_ranks_match_one(path: Path) -> None:
    """The model at `path` on 2 ranks: `_serve`'s tokens and cached counts of 1 rank, its
    logits within 1e-4 (fp32); every thread of its child on the child's cores; its child gone,
    rank 0's cores given back, after close."""
    one = LLM(model=str(path), **CHUNKED)
    one_logits = _spy_logits(one)
    want, want_cached = _serve(one)
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    with LLM(model=str(path), tensor_parallel_size=2, **CHUNKED) as two:
        children = [psutil.Process(pid) for pid in two.engine.ranks.pids]
        assert len(children) == 1 and children[0].is_running()
        # every thread of rank 1's process on its share of the cores, those its imports
        # started before it pinned itself included
        share = frozenset(split_cpus(sorted(affinity), 2)[1])
        assert {frozenset(os.sched_getaffinity(t.id)) for t in children[0].threads()} == {share}
        two_logits = _spy_logits(two)
        got, cached = _serve(two)
    assert got == want
    assert cached == want_cached == [48, 32]
    assert len(two_logits) == len(one_logits)
    for a, b in zip(two_logits, one_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not any(c.is_running() for c in children)
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads


def test_ranks_without_shared_memory_sum_over_gloo_alike(tiny_model, monkeypatch):
    """Where the shared-memory all-reduce does not apply (not x86-64), a process group does."""
    monkeypatch.setattr(rank_group, "uses_shared_memory", lambda device: False)
    path = tiny_model("llama")
    want = LLM(model=str(path), **CHUNKED).generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(model=str(path), tensor_parallel_size=2, **CHUNKED) as two:
        assert two.engine.ranks._shm_path is None
        got = two.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_a_killed_rank_fails_the_next_generate_without_hanging(tiny_model):
    with LLM(model=str(tiny_model("llama")), tensor_parallel_size=2, **CHUNKED) as llm:
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        (pid,) = llm.engine.ranks.pids
        os.kill(pid, signal.SIGKILL)
        raised: list[BaseException] = []

        def generate() -> None:
            try:
                llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False)
            except BaseException as e:  # the test inspects it
                raised.append(e)

        thread = threading.Thread(target=generate, daemon=True)
        thread.start()
        thread.join(STEP_LIMIT_S)
        assert not thread.is_alive(), "generate hung after a rank died"
        assert len(raised) == 1 and isinstance(raised[0], RankFailed)
        assert f"rank 1 (pid {pid}) was killed by SIGKILL" in str(raised[0])
        with pytest.raises(RankFailed, match="close it and start a new one"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


def test_heads_that_do_not_split_are_refused_before_any_process_starts(tiny_model):
    before = psutil.Process().children()
    with pytest.raises(ValueError, match=r"tensor-parallel size 3 does not split 4 attention "
                                         r"heads over 2 KV heads"):
        LLM(model=str(tiny_model("llama")), dtype="float32", max_model_len=256,
            tensor_parallel_size=3)
    assert psutil.Process().children() == before


def test_models_without_a_split_are_refused(tiny_model):
    """An MLA model's ranks each need a whole query head (the tiny DeepSeek has 3)."""
    before = psutil.Process().children()
    with pytest.raises(ValueError, match=r"tensor-parallel size 4 exceeds the 3 attention heads "
                                         r"of this DeepseekV3ForCausalLM: .* choose a size of "
                                         r"at most 3"):
        LLM(model=str(tiny_model("deepseek_v3")), dtype="float32", max_model_len=256,
            tensor_parallel_size=4)
    assert psutil.Process().children() == before


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_a_disaggregated_role_on_cuda_is_refused(role):
    with pytest.raises(ValueError, match=f"a {role.value} engine on cuda moves its KV .* a "
                                         f"pool per device, which the transfer plane does not "
                                         f"move"):
        EngineConfig(role=role, tensor_parallel_size=2, device="cuda")
    assert EngineConfig(role=role, tensor_parallel_size=2).tensor_parallel_size == 2


def test_uneven_heads_split_into_whole_kv_heads_and_mlp_columns_even_out_the_weights():
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=576,
                      intermediate_size=1536, num_layers=1, num_heads=9, num_kv_heads=3,
                      head_dim=64, max_position_embeddings=64, rms_norm_eps=1e-5,
                      rope_theta=1e4)
    plans = [shard_plan(cfg, 2, r) for r in range(2)]
    assert [(p.q_heads, p.kv_heads, p.mlp_columns) for p in plans] == [
        (range(0, 3), range(0, 1), range(0, 864)), (range(3, 9), range(1, 3), range(864, 1536))]


def test_worker_help_shows_the_flag():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "worker", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--tensor-parallel-size N" in out


def test_a_collocated_worker_on_two_ranks_serves_a_completion(tiny_model):
    port = free_port()
    worker = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "worker", "--model", str(tiny_model("llama")),
         "--dtype", "float32", "--port", str(port), "--serve-public", "--max-model-len", "256",
         "--kv-cache-memory", "16MiB", "--tensor-parallel-size", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, worker)
        ranks = [p for p in psutil.Process(worker.pid).children(recursive=True)
                 if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 1
        body = json.dumps({"model": str(tiny_model("llama")), "prompt": [5, 6, 7],
                           "max_tokens": 8, "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=STEP_LIMIT_S) as r:
            answer = json.loads(r.read())
        assert answer["usage"]["completion_tokens"] == 8
        with LLM(model=str(tiny_model("llama")), dtype="float32", max_model_len=256) as one:
            want = one.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8,
                                                            ignore_eos=True), use_tqdm=False)
        assert answer["choices"][0]["text"] == want[0].outputs[0].text
    finally:
        worker.terminate()
        worker.wait(60)
    psutil.wait_procs(ranks, timeout=30)
    assert not any(p.is_running() for p in ranks)


def _wait_ready(url: str, worker: subprocess.Popen) -> None:
    deadline = time.monotonic() + WORKER_START_S
    while True:
        assert worker.poll() is None, worker.stderr.read().decode()[-2000:]
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "the worker never became ready"
        time.sleep(0.2)
