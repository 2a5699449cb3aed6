"""pdserve's compiled CPU operators against the PyTorch operators they replace (bf16)."""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from pdserve import LLM, SamplingParams
from pdserve.engine import kernels
from pdserve.engine.model.attention import DecodeGroup, _decode
from pdserve.engine.model.rope import apply_rope
from pdserve.engine.sampler import Sampler
from tests.conftest import KV_BLOCKS

BF16 = torch.bfloat16


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of bf16's spacing at b (2^-7 relative)."""
    return (a.float() - b.float()).abs() / (b.float().abs() * 2**-7).clamp_min(1e-6)


def _norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * F.rms_norm(x.float(), w.shape, eps=eps).to(x.dtype)


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("hidden", [64, 576, 100])  # 100: a partial vector at the end
def test_add_rms_norm_rounds_where_the_pytorch_ops_round(ops, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x, r = (torch.randn(rows, hidden, generator=gen).to(BF16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(BF16)
    out, total = ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(total, x + r)  # the residual stream is bit for bit the separate add
    # the fp32 mean is summed in another order: at most one bf16 step apart, nearly always 0
    ref = _norm_ref(x + r, w, 1e-5)
    assert _ulps(out, ref).max() <= 1
    assert (out != ref).float().mean() < 0.01
    assert _ulps(ops.rms_norm(x, w, 1e-5), _norm_ref(x, w, 1e-5)).max() <= 1


@pytest.mark.parametrize("rows", [1, 7])
def test_silu_mul_is_the_fp32_product_rounded_once(ops, rows):
    gen = torch.Generator().manual_seed(rows)
    gate_up = (3 * torch.randn(rows, 2 * 200, generator=gen)).to(BF16)
    g, u = gate_up.float().split(200, dim=-1)
    want = (F.silu(g) * u).to(BF16)
    assert _ulps(ops.silu_mul(gate_up), want).max() <= 1


def test_rope_rotates_q_and_k_in_place_and_leaves_v(ops):
    t, heads, d, width = 6, 4, 64, 6 * 64
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, width, generator=gen).to(BF16)
    angles = torch.rand(50, d // 2, generator=gen) * 6
    angles = torch.cat([angles, angles], dim=1)
    cos = angles.cos()
    sin_signed = angles.sin() * torch.cat([-torch.ones(d // 2), torch.ones(d // 2)])
    pos = torch.tensor([0, 3, 49, 7, 7, 1])
    before = qkv.clone()
    want = apply_rope(before[:, : heads * d].float().view(t, heads, d),
                      cos[pos][:, None], sin_signed[pos][:, None])
    ops.rope_(qkv, pos, cos, sin_signed, heads, d)
    torch.testing.assert_close(qkv[:, : heads * d].view(t, heads, d).float(), want,
                               atol=0.02, rtol=0.01)
    assert torch.equal(qkv[:, heads * d:], before[:, heads * d:])
    with pytest.raises(RuntimeError, match="position 50 is outside the 50-row rope table"):
        ops.rope_(qkv, torch.tensor([0, 0, 0, 0, 0, 50]), cos, sin_signed, heads, d)


def _paged(gen, lens: list[int], kvh: int, d: int, bs: int = 16, num_blocks: int = 40):
    """A cache of the engine's layout (blocks strided by the other layers) and block tables
    that scatter each request's context over random blocks."""
    data = torch.randn(num_blocks, 3, 2, bs, kvh, d, generator=gen).to(BF16)
    k_cache, v_cache = data[:, 1, 0], data[:, 1, 1]
    width = max(-(-n // bs) for n in lens)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: len(lens) * width].view(len(lens), width)
    return k_cache, v_cache, tables


def test_store_kv_writes_each_row_where_index_put_would(ops):
    gen = torch.Generator().manual_seed(2)
    data = torch.zeros(6, 3, 2, 16, 3, 64).to(BF16)  # the engine's layout: layers between
    want = data.clone()
    qkv = torch.randn(5, 15 * 64, generator=gen).to(BF16)  # k, v: strided views, as in the model
    k, v = qkv[:, 9 * 64: 12 * 64].view(5, 3, 64), qkv[:, 12 * 64:].view(5, 3, 64)
    blocks, offsets = torch.tensor([4, 4, 0, 5, 2]), torch.tensor([0, 15, 3, 7, 7])
    ops.store_kv_(k, v, data[:, 1, 0], data[:, 1, 1], blocks, offsets)
    want[:, 1, 0][blocks, offsets] = k
    want[:, 1, 1][blocks, offsets] = v
    assert torch.equal(data, want)
    with pytest.raises(RuntimeError, match=r"slot \(block 6, offset 0\) is outside the pool"):
        ops.store_kv_(k, v, data[:, 1, 0], data[:, 1, 1], torch.tensor([0, 0, 0, 0, 6]),
                      torch.zeros(5, dtype=torch.long))


@pytest.mark.parametrize(("heads", "kvh", "d"), [(9, 3, 64), (4, 4, 64), (8, 1, 128)])
def test_decode_attention_matches_the_padded_sdpa_path(ops, heads, kvh, d):
    gen = torch.Generator().manual_seed(heads * d)
    lens = [1, 16, 17, 45, 80]  # one position, exactly a block, a block and one, longer
    k_cache, v_cache, tables = _paged(gen, lens, kvh, d)
    # q as the model gives it: a view of qkv rows, so rows are strided
    qkv = torch.randn(len(lens), (heads + 2 * kvh) * d, generator=gen).to(BF16)
    q = qkv[:, : heads * d].view(len(lens), heads, d)
    lengths = torch.tensor(lens)
    group = DecodeGroup(0, tables.flatten(), lengths, 16)
    want = _decode(q, k_cache, v_cache, group, d**-0.5)
    got = ops.decode_attention(q, k_cache, v_cache, tables, lengths, d**-0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=0.02, rtol=0.02)


# 3, 4, 5, 7 and 8 query heads per KV head (the kernel is compiled for each G up to 8)
@pytest.mark.parametrize(("heads", "kvh", "d", "bs"), [(9, 3, 64, 16), (4, 1, 128, 4),
                                                   (5, 1, 64, 8), (14, 2, 64, 16),
                                                   (16, 2, 128, 16)])
def test_decode_attention_over_many_tiles_is_fp64_attention_and_batch_invariant(
        ops, heads, kvh, d, bs):
    """Contexts of one position, just under, at and past a 64-position tile, several tiles with
    a tail, and one, two and three 1,024-position partitions (merged afterwards), each scattered
    over random blocks whose free slots hold NaN (never read): the kernel's output is fp64
    attention's to bf16 rounding, and a request's result is the same bits alone as in the batch
    (one KV head per work item alone, every head in the batch) and on any number of threads."""
    gen = torch.Generator().manual_seed(heads * bs)
    lens = [1, 63, 64, 65, 200, 333, 1024, 1025, 2100]
    k_cache, v_cache, tables = _paged(gen, lens, kvh, d, bs,
                                      num_blocks=len(lens) * -(-max(lens) // bs))
    for r, n in enumerate(lens):  # the slots past each context in its last block
        for t in range(n, -(-n // bs) * bs):
            k_cache[tables[r, t // bs], t % bs] = float("nan")
            v_cache[tables[r, t // bs], t % bs] = float("nan")
    q = torch.randn(len(lens), heads, d, generator=gen).to(BF16)
    lengths = torch.tensor(lens)
    got = ops.decode_attention(q, k_cache, v_cache, tables, lengths, d**-0.5)
    g = heads // kvh
    for r, n in enumerate(lens):
        blocks = tables[r, : -(-n // bs)]
        k = k_cache[blocks].flatten(0, 1)[:n].double()  # [n, KVH, D]
        v = v_cache[blocks].flatten(0, 1)[:n].double()
        for h in range(heads):
            p = torch.softmax(k[:, h // g] @ q[r, h].double() * d**-0.5, dim=0)
            torch.testing.assert_close(got[r, h].double(), p @ v[:, h // g], atol=1e-2,
                                       rtol=1e-2)
        alone = ops.decode_attention(q[r:r + 1], k_cache, v_cache, tables[r:r + 1],
                                     lengths[r:r + 1], d**-0.5)
        assert torch.equal(alone[0], got[r])
    threads = torch.get_num_threads()
    try:  # the items are shared out by positions per thread: any count, the same bits
        for n in (1, 3, 5):
            torch.set_num_threads(n)
            again = ops.decode_attention(q, k_cache, v_cache, tables, lengths, d**-0.5)
            assert torch.equal(again, got), n
    finally:
        torch.set_num_threads(threads)


def test_decode_attention_refuses_what_it_cannot_read(ops):
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, tables = _paged(gen, [20], 3, 64)
    q = torch.randn(1, 9, 64, generator=gen).to(BF16)
    with pytest.raises(RuntimeError, match="context length 40 does not fit a table of 2"):
        ops.decode_attention(q, k_cache, v_cache, tables, torch.tensor([40]), 0.125)
    bad = tables.clone()
    bad[0, 1] = 1000
    with pytest.raises(RuntimeError, match="block id 1000 is outside the pool"):
        ops.decode_attention(q, k_cache, v_cache, bad, torch.tensor([20]), 0.125)
    k32, v32, tables = _paged(gen, [20], 3, 32)
    with pytest.raises(RuntimeError, match="head sizes 64 and 128"):
        ops.decode_attention(q[..., :32], k32, v32, tables, torch.tensor([20]), 0.125)


# head_dim 64 and 3 query heads per KV head, as SmolLM2: the shape the operators serve
KERNEL_SHAPE = {"hidden_size": 96, "head_dim": 64, "num_attention_heads": 6,
                "num_key_value_heads": 2}


def _logits_by_request(llm: LLM) -> dict[str, list[torch.Tensor]]:
    """Records the logits each request sampled from, step by step."""
    seen: dict[str, list[torch.Tensor]] = {}
    run = llm.engine.runner.run

    def recording(batch, on_layer=None):
        logits, sampling = run(batch, on_layer)
        for row, req in zip(logits, sampling, strict=True):
            seen.setdefault(req.request_id, []).append(row.float().clone())
        return logits, sampling

    llm.engine.runner.run = recording
    return seen


def test_a_bf16_engine_with_the_operators_is_as_close_to_fp32_as_pytorch_ops(tiny_model):
    """bf16 runs of a random model part from fp32 (and from each other) within a few tokens:
    one rounding apart, a near-tie flips a token. So: the logits of every step where the
    fp32, the PyTorch-ops bf16 and the fused bf16 engines still agree on every token so far,
    and the fused engine's error against fp32 no larger than the PyTorch operators' own."""
    path = tiny_model("llama", **KERNEL_SHAPE)
    prompts = [[7], list(range(5, 12)), list(range(20, 77)), list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {"fused": ("bfloat16", True), "plain": ("bfloat16", False), "fp32": ("float32", False)}
    llms = {k: LLM(model=str(path), dtype=dt, max_model_len=256, cpu_kernels=ck,
                   num_kv_blocks=KV_BLOCKS) for k, (dt, ck) in runs.items()}
    assert llms["fused"].engine.model.fused is not None
    assert llms["plain"].engine.model.fused is None
    logits = {k: _logits_by_request(llm) for k, llm in llms.items()}
    outs = {k: llm.generate(prompts, params, use_tqdm=False) for k, llm in llms.items()}
    err: dict[str, list[float]] = {"fused": [], "plain": []}
    for i in range(len(prompts)):
        tokens = {k: o[i].outputs[0].token_ids for k, o in outs.items()}
        for step in range(params.max_tokens):
            if len({tuple(t[: step + 1]) for t in tokens.values()}) > 1:
                break
            rows = {k: logits[k][o[i].request_id][step] for k, o in outs.items()}
            for k in err:
                err[k].append(((rows[k] - rows["fp32"]).abs().max()
                               / rows["fp32"].abs().max()).item())
    assert len(err["fused"]) >= 12  # prefill and decode steps of every prompt were compared
    mean = {k: sum(v) / len(v) for k, v in err.items()}
    assert mean["fused"] <= 1.25 * mean["plain"], mean
    assert llms["fused"].engine.block_manager.num_used_blocks == 0


def test_fp32_and_unsupported_shapes_keep_the_pytorch_operators(tiny_model):
    assert LLM(model=str(tiny_model("llama", **KERNEL_SHAPE)), dtype="float32",
               max_model_len=64, num_kv_blocks=KV_BLOCKS).engine.model.fused is None
    assert LLM(model=str(tiny_model("llama")), dtype="bfloat16",  # head_dim 16
               max_model_len=64, num_kv_blocks=KV_BLOCKS).engine.model.fused is None


def test_a_failed_build_falls_back_to_pytorch_with_a_warning(monkeypatch, caplog, tmp_path):
    import torch.utils.cpp_extension as ext

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))  # no finished build to load

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'pdserve_cpu_ops': c++ not found")

    monkeypatch.setattr(ext, "load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.kernels"):
        assert kernels.cpu_ops.__wrapped__() is None
    assert "using PyTorch operators: Error building extension" in caplog.text


@pytest.mark.parametrize("vocab", [7, 100, 49152])
def test_argmax_rows_is_torchs_first_maximum_with_ties_nans_and_infinities(ops, vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = [torch.randn(vocab, generator=gen), torch.randint(0, 3, (vocab,), generator=gen).float(),
            torch.full((vocab,), -float("inf"))]
    for where, value in ((vocab // 2, float("nan")), (vocab - 1, float("inf")), (0, float("nan"))):
        row = torch.randn(vocab, generator=gen)
        row[where] = value
        rows.append(row)
    x = torch.stack(rows).to(BF16)
    assert torch.equal(ops.argmax_rows(x), x.max(dim=-1).indices)
    wide = torch.zeros(len(rows), vocab + 40, dtype=BF16)
    wide[:, 40:] = x  # rows further apart than their length
    assert torch.equal(ops.argmax_rows(wide[:, 40:]), x.max(dim=-1).indices)


def test_the_sampler_takes_greedy_bf16_rows_through_argmax_rows(ops):
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(3)).to(BF16)
    params = [SamplingParams(temperature=0)] * 8 + [SamplingParams(temperature=1.0, seed=5)] * 8
    calls = []

    class Spy:
        def argmax_rows(self, x):
            calls.append(x.shape)
            return ops.argmax_rows(x)

    plain, fused = Sampler(seed=1), Sampler(seed=1, fused=Spy())
    assert fused(logits, params, [0] * 16).token_ids == plain(logits, params, [0] * 16).token_ids
    assert calls == [(16, 1000)]


def test_the_operators_let_other_python_threads_run_meanwhile(ops):
    """A worker's HTTP thread sends one step's tokens while its engine thread runs the next
    step in these operators: they must release the GIL, as PyTorch's operators do. The
    operator runs on one thread, so the other core is free for a thread that ticks every
    0.5 ms; with a 10 s switch interval, an operator holding the GIL would stop the ticks for
    most of its run."""
    gate_up = torch.randn(2048, 2 * 8192).to(BF16)  # silu_mul over 64 MiB: tens of ms
    ticks: list[float] = []
    done = threading.Event()

    def ticker() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    interval, threads = sys.getswitchinterval(), torch.get_num_threads()
    sys.setswitchinterval(10.0)
    torch.set_num_threads(1)
    thread = threading.Thread(target=ticker)
    try:
        thread.start()
        while not ticks:
            time.sleep(0.001)
        spans = []
        for _ in range(3):
            start = time.perf_counter()
            ops.silu_mul(gate_up)
            spans.append((start, time.perf_counter()))
    finally:
        done.set()
        sys.setswitchinterval(interval)
        torch.set_num_threads(threads)
        thread.join()
    for start, end in spans:
        inside = [start, *(t for t in ticks if start < t < end), end]
        longest = max(b - a for a, b in itertools.pairwise(inside))
        assert longest < 0.5 * (end - start), (longest, end - start)
