"""`pdserve bench engine`: our engine beside transformers and the roofline, in one run.

Every number is the median of `repeats` runs measured in this process, on this machine, now,
except the roofs (bandwidth, matmul peak): the machine's ceiling, each the fastest of its runs
at the start and at the end of the bench (a shared machine's neighbours only ever hide it):
- decode tok/s at batch B: B requests with short prompts are prefilled, then `decode_steps`
  steps are timed (every request gets one token per step).
  transformers: `generate()` for 1 + decode_steps new tokens minus `generate()` for 1 (its
  prefill), same batch and prompt length, same dtype.
  roofline: every step reads every weight once, so tok/s <= B x bandwidth / weight bytes, with
  the bandwidth measured here by a large read (decode is memory-bound: each step reads
  every weight once).
  compute roof: every token costs its FLOPs (below), so tok/s <= peak matmul FLOP/s (in the
  dtype the engine's matmuls compute in: the bench's dtype, except fp32 for bf16 weights on
  the AVX2 kernel) measured here / FLOPs per token, whatever the batch. A step is bound by
  the lower of the two (Williams et al. 2009, "Roofline"); `of bound` is the share of that.
  Where the matmul peak is low against the bandwidth (no AMX: 32-row decode on AVX512-BF16 is
  compute-bound), the compute roof is the lower one.
- prefill tok/s for one prompt of each of `prompt_lens` tokens: one engine step; transformers:
  one `generate()` of 1 token. roofline: peak matmul FLOP/s measured here over the FLOPs
  per prompt token (2 x matmul parameters + attention, Kaplan et al. 2020, eq. 2.1 style count).
- prefill with a prefix-cache hit: a prompt of `cached_len` tokens whose first half is in the
  prefix cache (the same half was prefilled just before), so the step computes the second half
  against the cached first: tok/s of the computed tokens, with their FLOPs (attention over the
  cached half too). transformers has no prefix cache in generate(): no baseline ("-").
- chunked prefill: the same `cached_len` prompt in steps of `chunk` tokens (a second engine with
  that token budget per step), against the same roof as a whole prompt: per token, chunks
  should cost what the whole prompt costs (each step re-reads the earlier positions' KV from
  the pool, the same attention work in other steps).
Under the table, each longer whole prompt's rate over the rate at REFERENCE_PROMPT tokens (the
longest whole prompt up to it; else the shortest), beside the same ratio of their compute roofs:
what the attention's FLOPs, which grow with the prompt, leave of the shorter prompt's rate even
at the roof. The measured ratio can only reach the roofs' where both rows are equally far from
their roof; a model of small hidden size (SmolLM2: 576, head size 64) spends as many FLOPs on an
8k prompt's attention as on its linears, and its roofs' ratio is about one half.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from pdserve.bench.timing import fastest_seconds, median_seconds, synced
from pdserve.common.engine_options import check_device, resolve_dtype
from pdserve.common.model_config import ModelConfig
from pdserve.common.model_folder import resolve_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine import huge_pages
from pdserve.engine.engine import Engine
from pdserve.engine.model.packed_linear import LinearKernel, linear_kernel

# The prompt whose prefill rate a longer prompt's is set against: a typical chat or RAG turn.
REFERENCE_PROMPT = 1000


@dataclass(frozen=True)
class BenchRow:
    phase: str  # "decode" | "prefill"
    batch: int
    prompt_tokens: int
    pdserve_tok_s: float
    transformers_tok_s: float | None  # None: no like-for-like baseline (a prefix-cache hit)
    roofline_tok_s: float
    compute_roof_tok_s: float
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, not computed
    chunk_tokens: int = 0  # prompt tokens per step when the prompt went in chunks; 0: whole

    @property
    def bound_tok_s(self) -> float:
        return min(self.roofline_tok_s, self.compute_roof_tok_s)

    @property
    def of_bound(self) -> float:
        return self.pdserve_tok_s / self.bound_tok_s

    @property
    def vs_transformers(self) -> float | None:
        if self.transformers_tok_s is None:
            return None
        return self.pdserve_tok_s / self.transformers_tok_s

    @property
    def of_roofline(self) -> float:
        return self.pdserve_tok_s / self.roofline_tok_s


@dataclass(frozen=True)
class BenchSettings:
    model: str = "smollm2"
    batches: tuple[int, ...] = (1, 8, 32)
    decode_prompt_len: int = 32
    decode_steps: int = 32
    # 8,191: SmolLM2's 8,192 positions, less the one sampled token
    prompt_lens: tuple[int, ...] = (512, 1000, 2048, 8191)
    cached_len: int = 2048  # the prefix-cache row's prompt, half cached; 0: no such row
    chunk: int = 256  # the chunked row's tokens per step (its prompt: cached_len); 0: no row
    repeats: int = 3
    cpu_kernels: bool = True  # False: the engine on PyTorch operators only (the A/B baseline)
    # the engine on N processes, each on its share of this process's cores; this process is
    # rank 0, so transformers and the roofs then run on rank 0's share only
    tensor_parallel_size: int = 1
    dtype: str = "auto"  # both engines' and the matmul roof's (common/engine_options.py)
    # where both engines and the roofs run; on a GPU the roofs are its memory and its matmuls
    device: str = "cpu"
    enforce_eager: bool = False  # a GPU engine's decode steps without CUDA graphs

    def __post_init__(self) -> None:
        check_device(self.device)
        object.__setattr__(self, "dtype",
                           resolve_dtype(self.dtype, self.device, self.cpu_kernels))
        if not self.batches or min(self.batches) <= 0:
            raise ValueError("batches must be positive integers")
        if not self.prompt_lens or min(self.prompt_lens) <= 0:
            raise ValueError("prompt lengths must be positive integers")
        if self.cached_len < 0 or self.cached_len == 1:
            raise ValueError(f"cached_len must be 0 (no prefix-cache row) or at least 2, got "
                             f"{self.cached_len}")
        if self.chunk < 0 or (self.chunk and not self.cached_len):
            raise ValueError(f"chunk must be 0 (no chunked row) or positive with a cached_len "
                             f"prompt, got {self.chunk}")
        for name in ("decode_prompt_len", "decode_steps", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def max_prompt(self) -> int:
        return max(*self.prompt_lens, self.cached_len, self.decode_prompt_len)


def memory_bandwidth(repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s of a 1 GiB read (torch.amax over all threads, or the GPU's memory), its fastest
    run: the decode roofline's bound.
    On a CPU on huge pages, as the engine's weights and KV pool are: with 4 KiB pages the same
    read measured 14-15 GB/s here against 27 on huge pages (page walks,
    engine/huge_pages.py)."""
    shape = (256 * 2**20,)
    x = (huge_pages.zeros(shape, torch.float32) if device == "cpu"
         else torch.zeros(shape, device=device)).fill_(1.0)
    return x.numel() * x.element_size() / fastest_seconds(synced(lambda: x.amax(), device),
                                                          repeats)


def matmul_flops(dtype: torch.dtype, repeats: int = 5, device: str = "cpu") -> float:
    """FLOP/s of an n^3 matmul, its fastest run: the compute roof. On a CPU n = MATMUL_N,
    halved while a probe says one run would take over MATMUL_BUDGET_S (a CPU that emulates
    bf16 takes minutes over 2,048^3 repeats; its roof is low at any size); on a GPU
    GPU_MATMUL_N, which keeps its tensor cores busy for a millisecond or more."""
    n = matmul_size(dtype) if device == "cpu" else GPU_MATMUL_N
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    return 2 * n**3 / fastest_seconds(synced(lambda: a @ b, device), repeats)


MATMUL_N, MATMUL_PROBE_N, MATMUL_BUDGET_S, GPU_MATMUL_N = 2048, 256, 0.5, 8192


def matmul_size(dtype: torch.dtype) -> int:
    """The largest power-of-two n <= MATMUL_N whose n^3 matmul the probe's rate (cube law)
    puts within MATMUL_BUDGET_S."""
    probe = torch.randn(MATMUL_PROBE_N, MATMUL_PROBE_N, dtype=dtype)
    seconds = median_seconds(lambda: probe @ probe, 3)
    n = MATMUL_N
    while n > MATMUL_PROBE_N and seconds * (n / MATMUL_PROBE_N) ** 3 > MATMUL_BUDGET_S:
        n //= 2
    return n


def weight_bytes_per_step(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Bytes a decode step reads: every layer, the final norm and the LM head (the embedding
    lookup reads only B rows and is left out)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    attn = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
    per_layer = attn + 3 * h * i + 2 * h
    return (cfg.num_layers * per_layer + h + cfg.vocab_size * h) * dtype_bytes


def flops_per_token(cfg: ModelConfig, context: float, lm_head_share: float = 1.0) -> float:
    """2 x matmul weights per token, plus attention: QK^T and PV over `context` positions,
    2 x 2 x heads x head_dim x context per layer (Kaplan et al. 2020, eq. 2.1 style count); the
    LM head on `lm_head_share` of the tokens (a prefill samples only its last one)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    matmul = cfg.num_layers * (h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d
                               + cfg.num_heads * d * h + 3 * h * i)
    attention = cfg.num_layers * 4 * cfg.num_heads * d * context
    return 2 * matmul + attention + 2 * cfg.vocab_size * h * lm_head_share


def prefill_flops_per_token(cfg: ModelConfig, prompt_len: int, cached: int = 0) -> float:
    """A computed prompt token attends to the `cached` positions and half the causal context of
    the `prompt_len` computed ones on average; the LM head runs once."""
    return flops_per_token(cfg, cached + prompt_len / 2, 1 / prompt_len)


class RandomPrompts:
    """Distinct random prompts, so no run is served by another's prefix cache."""

    def __init__(self, vocab_size: int) -> None:
        self.gen = torch.Generator().manual_seed(0)
        self.vocab = vocab_size

    def __call__(self, batch: int, length: int) -> list[list[int]]:
        return torch.randint(100, self.vocab, (batch, length), generator=self.gen).tolist()


def pdserve_decode(engine: Engine, prompts: RandomPrompts, batch: int, s: BenchSettings) -> float:
    def run() -> float:
        params = SamplingParams(temperature=0, max_tokens=s.decode_steps + 1, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in prompts(batch, s.decode_prompt_len)]
        while any(engine.requests[r].num_output_tokens == 0 for r in ids):
            engine.step()  # prefill every request first
        t0 = time.perf_counter()
        for _ in range(s.decode_steps):
            engine.step()
        elapsed = time.perf_counter() - t0
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed

    run()  # warm-up
    return batch * s.decode_steps / statistics.median(run() for _ in range(s.repeats))


def _prefill_once(engine: Engine, prompt: list[int]) -> None:
    engine.add_request(prompt, SamplingParams(max_tokens=1))
    engine.step()
    if engine.has_unfinished_requests():
        raise RuntimeError("the prompt did not prefill in one step")


def pdserve_prefill(engine: Engine, prompts: RandomPrompts, length: int, repeats: int) -> float:
    return length / median_seconds(lambda: _prefill_once(engine, prompts(1, length)[0]),
                                   repeats)


def cached_half(length: int, block_size: int) -> int:
    """The prefix-cache row's cached tokens: the first half of its prompt, in whole blocks."""
    return length // 2 // block_size * block_size


def pdserve_cached_prefill(engine: Engine, prompts: RandomPrompts, length: int,
                           repeats: int) -> float:
    """tok/s of the second half of a `length`-token prompt whose first half (whole blocks) is
    in the prefix cache: each run prefills a fresh first half untimed, then times the prompt."""
    half = cached_half(length, engine.config.block_size)
    times = []
    for _ in range(repeats + 1):  # the first is the warm-up
        prompt = prompts(1, length)[0]
        _prefill_once(engine, prompt[:half] + prompts(1, 1)[0])  # caches the half's blocks
        t0 = time.perf_counter()
        _prefill_once(engine, prompt)
        times.append(time.perf_counter() - t0)
    return (length - half) / statistics.median(times[1:])


def hf_generate_seconds(model, ids: torch.Tensor, new_tokens: int, repeats: int) -> float:
    """`ids` on the model's device."""
    mask = torch.ones_like(ids)

    def run() -> None:
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    return median_seconds(synced(run, str(ids.device)), repeats)


def hf_decode(model, prompts: RandomPrompts, batch: int, s: BenchSettings) -> float:
    ids = torch.tensor(prompts(batch, s.decode_prompt_len), device=s.device)
    full = hf_generate_seconds(model, ids, s.decode_steps + 1, s.repeats)
    first = hf_generate_seconds(model, ids, 1, s.repeats)
    return batch * s.decode_steps / max(full - first, 1e-9)


def pdserve_chunked_prefill(s: BenchSettings, prompts: RandomPrompts, max_model_len: int) -> float:
    """tok/s of a `cached_len`-token prompt computed `chunk` tokens a step, on an engine whose
    step budget is `chunk` (the same prompts as the whole-prompt rows: random ids)."""
    engine = Engine(EngineConfig(model=s.model, dtype=s.dtype, max_model_len=max_model_len,
                                 enable_prefix_caching=False, enable_chunked_prefill=True,
                                 max_num_batched_tokens=s.chunk, cpu_kernels=s.cpu_kernels,
                                 tensor_parallel_size=s.tensor_parallel_size, device=s.device,
                                 enforce_eager=s.enforce_eager))

    def run() -> None:
        engine.add_request(prompts(1, s.cached_len)[0], SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()

    try:
        return s.cached_len / median_seconds(run, s.repeats)
    finally:
        engine.close()


def run_bench(s: BenchSettings, log: Callable[[str], None]) -> list[BenchRow]:
    from transformers import AutoModelForCausalLM

    path = resolve_model(s.model)
    cfg = ModelConfig.from_folder(path)
    log(f"loading {s.model} ({s.dtype}) into pdserve and transformers ...")
    if s.max_prompt >= cfg.max_context:
        raise ValueError(f"prompts of {s.max_prompt} tokens leave no position to sample in "
                         f"{s.model}'s {cfg.max_context}")
    engine = Engine(EngineConfig(
        model=s.model, dtype=s.dtype,
        max_model_len=min(cfg.max_context, s.max_prompt + 64 + s.decode_steps),
        enable_prefix_caching=s.cached_len > 0, cpu_kernels=s.cpu_kernels,
        tensor_parallel_size=s.tensor_parallel_size, device=s.device,
        enforce_eager=s.enforce_eager, max_num_seqs=max(64, *s.batches)))
    dtype = getattr(torch, s.dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(s.device).eval()
    prompts = RandomPrompts(cfg.vocab_size)
    roof_dtype = _arithmetic_dtype(engine, dtype)
    # here and again at the end: the best of both is the roof
    roofs = _measure_roofs(roof_dtype, s.device)
    log(f"measured: memory read {roofs[0] / 1e9:.1f} GB/s, {_name(roof_dtype)} matmul "
        f"{roofs[1] / 1e9:.0f} "
        f"GFLOP/s, {torch.get_num_threads()} threads; pdserve on {_operators(engine)}"
        f"{_ranks(s.tensor_parallel_size)}")
    runs = []
    for batch in s.batches:
        log(f"decode, batch {batch} ...")
        runs.append(("decode", batch, s.decode_prompt_len,
                     pdserve_decode(engine, prompts, batch, s), hf_decode(hf, prompts, batch, s)))
    for length in s.prompt_lens:
        log(f"prefill, {length}-token prompt ...")
        hf_prefill = length / hf_generate_seconds(
            hf, torch.tensor(prompts(1, length), device=s.device), 1, s.repeats)
        runs.append(("prefill", 1, length, pdserve_prefill(engine, prompts, length, s.repeats),
                     hf_prefill))
    if s.cached_len:
        log(f"prefill, {s.cached_len}-token prompt, its first half in the prefix cache ...")
        cached = pdserve_cached_prefill(engine, prompts, s.cached_len, s.repeats)
    engine.close()  # before the chunked row's engine: each splits this process's cores
    if s.chunk:
        log(f"prefill, {s.cached_len}-token prompt in chunks of {s.chunk} ...")
        chunked = pdserve_chunked_prefill(s, prompts, engine.config.max_model_len)
    bandwidth, flops = (max(a, b) for a, b in zip(roofs, _measure_roofs(roof_dtype, s.device),
                                                          strict=True))
    log(f"roofs (best of the start and the end): memory read {bandwidth / 1e9:.1f} GB/s, "
        f"{_name(roof_dtype)} matmul {flops / 1e9:.0f} GFLOP/s")
    step_floor = weight_bytes_per_step(cfg, dtype.itemsize) / bandwidth
    decode_roof = flops / flops_per_token(cfg, s.decode_prompt_len + s.decode_steps / 2)
    rows = []
    for run in runs:
        if run[0] == "decode":
            rows.append(BenchRow(*run, run[1] / step_floor, decode_roof))
        else:
            roof = flops / prefill_flops_per_token(cfg, run[2])
            rows.append(BenchRow(*run, roof, roof))
    if s.cached_len:
        half = cached_half(s.cached_len, engine.config.block_size)
        roof = flops / prefill_flops_per_token(cfg, s.cached_len - half, cached=half)
        rows.append(BenchRow("prefill", 1, s.cached_len, cached, None, roof, roof, half))
    if s.chunk:
        roof = flops / prefill_flops_per_token(cfg, s.cached_len)
        rows.append(BenchRow("prefill", 1, s.cached_len, chunked, None, roof, roof,
                             chunk_tokens=s.chunk))
    return rows


def _arithmetic_dtype(engine: Engine, dtype: torch.dtype) -> torch.dtype:
    """The dtype the engine's matmuls compute in, whose peak is the compute roof: float32 for
    bf16 weights on the AVX2 kernel (fp32 FMAs over widened weights; PyTorch's own bf16
    matmul there is emulated, ~1 GFLOP/s), else the weights' dtype."""
    kernel = _linear_kernel(engine)
    return torch.float32 if kernel is not None and kernel.name == "avx2" else dtype


def _linear_kernel(engine: Engine) -> LinearKernel | None:
    """The pdserve kernel the engine's linears run on (None: oneDNN or PyTorch)."""
    fused = engine.model.fused
    return None if fused is None else linear_kernel(fused)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _measure_roofs(dtype: torch.dtype, device: str) -> tuple[float, float]:
    return memory_bandwidth(device=device), matmul_flops(dtype, device=device)


def _ranks(size: int) -> str:
    return "" if size == 1 else f", {size} tensor-parallel ranks (these numbers: rank 0's share)"


def _operators(engine: Engine) -> str:
    runner = engine.runner
    if engine.kv_cache.data.is_cuda:
        return (f"{engine.config.device}, decode attention on "
                f"{'SDPA' if runner.kernels is None else 'Triton'}, decode steps "
                f"{'eager' if runner.graphs is None else 'from CUDA graphs'}")
    if engine.model.fused is None:
        return "PyTorch operators"
    kernel = _linear_kernel(engine)
    attention = engine.model.fused.prefill_attention_kernel() or "SDPA"
    return (f"its fused CPU operators, linears on "
            f"{'oneDNN' if kernel is None else kernel.name}, prefill attention on {attention}")


def length_scaling(rows: list[BenchRow]) -> list[str]:
    """The lines on longer prompts under the table (see the module docstring); none with fewer
    than two whole prompts."""
    whole = sorted((r for r in rows if r.phase == "prefill" and not r.cached_tokens
                    and not r.chunk_tokens), key=lambda r: r.prompt_tokens)
    if len(whole) < 2:
        return []
    short = [r for r in whole if r.prompt_tokens <= REFERENCE_PROMPT]
    ref = short[-1] if short else whole[0]
    return [f"prefill at {r.prompt_tokens:,} tokens: {r.pdserve_tok_s / ref.pdserve_tok_s:.2f}x "
            f"the rate at {ref.prompt_tokens:,} (the compute roofs: "
            f"{r.compute_roof_tok_s / ref.compute_roof_tok_s:.2f}x)"
            for r in whole if r.prompt_tokens > ref.prompt_tokens]


def format_table(rows: list[BenchRow]) -> str:
    head = (f"{'phase':<8}{'batch':>6}{'prompt':>8}{'cached':>8}{'chunk':>7}{'pdserve tok/s':>15}"
            f"{'transformers':>14}{'x HF':>7}{'roofline':>10}{'of roofline':>13}"
            f"{'compute roof':>14}{'of bound':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        hf = "-" if r.transformers_tok_s is None else f"{r.transformers_tok_s:.1f}"
        ratio = "-" if r.vs_transformers is None else f"{r.vs_transformers:.2f}"
        chunk = r.chunk_tokens or "-"
        lines.append(f"{r.phase:<8}{r.batch:>6}{r.prompt_tokens:>8}{r.cached_tokens:>8}{chunk:>7}"
                     f"{r.pdserve_tok_s:>15.1f}{hf:>14}{ratio:>7}"
                     f"{r.roofline_tok_s:>10.0f}{r.of_roofline:>12.0%}"
                     f"{r.compute_roof_tok_s:>15.0f}{r.of_bound:>9.0%}")
    return "\n".join([*lines, *length_scaling(rows)])


def main(s: BenchSettings, as_json: bool) -> int:
    rows = run_bench(s, lambda msg: print(msg, file=sys.stderr, flush=True))
    if as_json:
        for r in rows:
            ratio = None if r.vs_transformers is None else round(r.vs_transformers, 3)
            print(json.dumps(asdict(r) | {"vs_transformers": ratio,
                                          "of_roofline": round(r.of_roofline, 3),
                                          "of_bound": round(r.of_bound, 3)}))
    else:
        print(format_table(rows))
    return 0
