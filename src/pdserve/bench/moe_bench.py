"""`pdserve bench moe`: does a MoE decode step read only the experts its router chose?

For each model of `moe_models` (random weights, bf16, written to a temporary folder) and each
batch size B, B requests are prefilled and then `decode_steps` engine steps are timed, each
giving every request one token. Per step:
- required bytes: what the step must read. Every checkpoint tensor but the routed experts and
  the input embedding (attention, norms, routers, shared experts, dense layers, lm_head), B
  rows of the embedding, the KV the step attends over (its context tokens x KV bytes per
  token), and in each MoE layer the experts the router chose for this step: the distinct ids
  passed to that layer's `Experts`, recorded by a forward hook (never assumed from top_k).
  Tensor sizes come from the safetensors headers, in the dtype the engine holds them (the
  folder is bf16, DeepSeek's routers fp32 as in the engine).
- effective bytes: the measured step time x the machine's read bandwidth, measured in this
  run (`engine_bench.memory_bandwidth`: torch.amax over 1 GiB on huge pages, all threads, the
  fastest run, at the start and at the end, the better of the two).
- effective / required: 1.0 is a step that streams exactly its bytes at the machine's read
  bandwidth; above it, time spent on anything else (Python, dispatch, small matmuls below
  the bandwidth, the sampler). A step that read every expert would be near
  dense-equivalent / required (every routed expert of every MoE layer read, shown beside).
Step times are medians over `repeats` runs (each the mean of its `decode_steps` steps, after
one warm-up run); the byte counts are the means over every timed step.
"""

from __future__ import annotations

import gc
import json
import re
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from pdserve.bench.engine_bench import memory_bandwidth
from pdserve.bench.moe_models import MOE_MODELS, TOP_K, MoeBenchShape, write_moe_model
from pdserve.common.model_folder import weight_files
from pdserve.common.sampling_params import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.model.moe import Experts
from pdserve.engine.model.packed_experts import PackedExperts

BANDWIDTH_BASELINE = "torch.amax over 1 GiB fp32 on huge pages, all threads, fastest of 5"
_EXPERT_TENSOR = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
_EMBEDDING = "model.embed_tokens.weight"


@dataclass(frozen=True)
class MoeBenchSettings:
    models: tuple[str, ...] = MOE_MODELS
    batches: tuple[int, ...] = (1, 4)
    shape: MoeBenchShape = field(default_factory=MoeBenchShape)
    prompt_len: int = 16
    decode_steps: int = 16
    repeats: int = 3
    threads: int | None = None  # None: torch's default (every core)

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in MOE_MODELS]
        if not self.models or unknown:
            raise ValueError(f"models must be some of {', '.join(MOE_MODELS)}, got "
                             f"{', '.join(self.models) or 'none'}")
        if not self.batches or min(self.batches) <= 0:
            raise ValueError("batches must be positive integers")
        for name in ("prompt_len", "decode_steps", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads must be positive, got {self.threads}")


@dataclass(frozen=True)
class WeightBytes:
    """A checkpoint's tensor bytes, split as a decode step reads them. `expert`: MoE layer ->
    bytes of one routed expert (gate, up and down)."""

    dense: int  # every tensor but the routed experts and the input embedding
    embedding_row: int  # one row of the input embedding; 0 when tied (lm_head reads it all)
    expert: dict[int, int]
    num_experts: int

    def step(self, batch: int, active: dict[int, int]) -> int:
        """Weight bytes of a step over `batch` tokens whose layers chose `active` experts."""
        return self.dense + batch * self.embedding_row + sum(
            self.expert[layer] * n for layer, n in active.items())

    def dense_equivalent(self, batch: int) -> int:
        """The same step if every routed expert were read."""
        return self.step(batch, {layer: self.num_experts for layer in self.expert})


def safetensors_nbytes(path: Path) -> dict[str, int]:
    """Bytes of every tensor in the folder's safetensors, from their headers (no data read)."""
    sizes = {}
    for file in weight_files(path):
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        sizes |= {name: t["data_offsets"][1] - t["data_offsets"][0]
                  for name, t in header.items() if name != "__metadata__"}
    return sizes


def weight_bytes(sizes: dict[str, int], vocab_size: int) -> WeightBytes:
    """Split `sizes` (HF names, one tensor per expert) into a step's dense and expert bytes."""
    per_expert: dict[tuple[int, int], int] = {}
    dense = embedding_row = 0
    for name, n in sizes.items():
        match = _EXPERT_TENSOR.match(name)
        if match:
            key = (int(match[1]), int(match[2]))
            per_expert[key] = per_expert.get(key, 0) + n
        elif name == _EMBEDDING and "lm_head.weight" in sizes:
            embedding_row = n // vocab_size
        else:
            dense += n
    expert = {layer: n for (layer, _), n in per_expert.items()}
    counts = {layer: sum(1 for (lay, _) in per_expert if lay == layer) for layer in expert}
    if not expert or len(set(counts.values())) != 1:
        raise ValueError("the checkpoint must hold the same number of per-expert tensors in "
                         "every MoE layer (model.layers.L.mlp.experts.E.*)")
    return WeightBytes(dense, embedding_row, expert, next(iter(counts.values())))


class ActiveExperts:
    """Forward hooks on every `Experts` (or `PackedExperts`) of a model: while recording, the
    distinct experts each MoE layer was asked to run. Hooks live as long as this object's
    model; `close` removes them."""

    def __init__(self, model: nn.Module) -> None:
        self.recording = False
        self._calls: list[tuple[int, torch.Tensor]] = []
        self._handles = [m.register_forward_hook(self._hook(int(name.split(".")[1])))
                         for name, m in model.named_modules()
                         if isinstance(m, Experts | PackedExperts)]
        if not self._handles:
            raise ValueError("the model has no routed experts")

    def _hook(self, layer: int) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if self.recording:
                self._calls.append((layer, args[1]))  # topk_ids [T, k]
        return record

    def take(self) -> dict[int, int]:
        """MoE layer -> distinct experts chosen since the last take (one forward each)."""
        active: dict[int, int] = {}
        for layer, ids in self._calls:
            if layer in active:
                raise RuntimeError(f"MoE layer {layer} ran twice in one step")
            active[layer] = int(torch.unique(ids).numel())
        self._calls.clear()
        return active

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass(frozen=True)
class MoeRow:
    model: str
    batch: int
    top_k: int
    step_ms: float  # median over repeats of the mean decode step
    active_experts_mean: tuple[float, ...]  # per MoE layer, mean over the timed steps
    active_experts_max: tuple[int, ...]  # per MoE layer, most in any timed step
    dense_bytes: int  # per step: everything but the routed experts, embedding rows included
    expert_bytes: int  # per step, mean: the chosen experts
    kv_bytes: int  # per step, mean: the KV attended over
    required_bytes: int  # dense + expert + kv
    dense_equivalent_bytes: int  # every routed expert read, plus the same dense and kv
    bandwidth_gbps: float
    baseline: str = BANDWIDTH_BASELINE

    @property
    def effective_bytes(self) -> float:
        return self.step_ms / 1e3 * self.bandwidth_gbps * 1e9

    @property
    def ratio(self) -> float:
        """effective / required: 1.0 streams exactly the bytes needed at the read bandwidth."""
        return self.effective_bytes / self.required_bytes

    @property
    def saving(self) -> float:
        """dense-equivalent / required: how much reading only the chosen experts saves."""
        return self.dense_equivalent_bytes / self.required_bytes


@dataclass(frozen=True)
class _Run:
    step_s: float
    active: list[dict[int, int]]  # per timed step
    context: list[int]  # per timed step: tokens attended over


def _decode_run(engine: Engine, recorder: ActiveExperts, prompts: list[list[int]],
                steps: int) -> _Run:
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    while any(engine.requests[r].num_output_tokens == 0 for r in ids):
        engine.step()  # prefill every request first
    elapsed, active, context = 0.0, [], []
    for _ in range(steps):
        recorder.recording = True
        t0 = time.perf_counter()
        engine.step()
        elapsed += time.perf_counter() - t0
        recorder.recording = False
        active.append(recorder.take())
        stats = engine.take_step_stats()
        context.append(0 if stats is None else stats.decode_context)
    while engine.has_unfinished_requests():
        engine.step()
    return _Run(elapsed / steps, active, context)


def _engine(path: Path, s: MoeBenchSettings) -> Engine:
    max_len = s.prompt_len + s.decode_steps + 8
    blocks = max(s.batches) * -(-max_len // 16) + 4
    return Engine(EngineConfig(model=str(path), dtype="bfloat16", max_model_len=max_len,
                               num_kv_blocks=blocks, enable_prefix_caching=False))


def bench_model(model: str, path: Path, s: MoeBenchSettings,
                log: Callable[[str], None]) -> list[tuple[int, list[_Run], WeightBytes, int]]:
    """(batch, runs, weight bytes, KV bytes per token) for each batch size of `s`."""
    engine = _engine(path, s)
    cfg = engine.model_config
    weights = weight_bytes(safetensors_nbytes(path), cfg.vocab_size)
    kv_per_token = cfg.kv_bytes_per_token(2)
    recorder = ActiveExperts(engine.model)
    gen = torch.Generator().manual_seed(0)
    out = []
    try:
        for batch in s.batches:
            log(f"{model}: decode, batch {batch} ...")
            runs = [_decode_run(engine, recorder, torch.randint(
                        4, cfg.vocab_size, (batch, s.prompt_len), generator=gen).tolist(),
                        s.decode_steps) for _ in range(s.repeats + 1)]
            out.append((batch, runs[1:], weights, kv_per_token))  # the first: warm-up
    finally:
        recorder.close()
    return out


def _row(model: str, batch: int, runs: list[_Run], weights: WeightBytes, kv_per_token: int,
         bandwidth: float) -> MoeRow:
    steps = [(a, c) for run in runs for a, c in zip(run.active, run.context, strict=True)]
    layers = sorted(weights.expert)
    for active, _ in steps:
        if sorted(active) != layers:
            raise RuntimeError(f"a step ran MoE layers {sorted(active)}, the checkpoint has "
                               f"{layers}")
    dense = weights.step(batch, {})
    expert = statistics.mean(weights.step(batch, a) - dense for a, _ in steps)
    kv = statistics.mean(c * kv_per_token for _, c in steps)
    return MoeRow(
        model=model, batch=batch, top_k=TOP_K[model],
        step_ms=statistics.median(r.step_s for r in runs) * 1e3,
        active_experts_mean=tuple(statistics.mean(a[i] for a, _ in steps) for i in layers),
        active_experts_max=tuple(max(a[i] for a, _ in steps) for i in layers),
        dense_bytes=dense, expert_bytes=round(expert), kv_bytes=round(kv),
        required_bytes=round(dense + expert + kv),
        dense_equivalent_bytes=round(weights.dense_equivalent(batch) + kv),
        bandwidth_gbps=bandwidth / 1e9)


def run_bench(s: MoeBenchSettings, log: Callable[[str], None]) -> list[MoeRow]:
    if s.threads is not None:
        torch.set_num_threads(s.threads)
    bandwidth = memory_bandwidth()
    log(f"read bandwidth ({BANDWIDTH_BASELINE}): {bandwidth / 1e9:.1f} GB/s, "
        f"{torch.get_num_threads()} threads")
    measured = []
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-moe-") as tmp:
        for model in s.models:
            log(f"{model}: writing a random-weight model ({s.shape}) ...")
            path = write_moe_model(Path(tmp) / model, model, s.shape)
            measured += [(model, *m) for m in bench_model(model, path, s, log)]
            gc.collect()  # the engine's weights go before the next model's
    bandwidth = max(bandwidth, memory_bandwidth())
    log(f"read bandwidth, the better of the start and the end: {bandwidth / 1e9:.1f} GB/s")
    return [_row(*m, bandwidth) for m in measured]


def format_table(rows: list[MoeRow]) -> str:
    head = (f"{'model':<13}{'batch':>6}{'top-k':>6} {'chosen experts/layer':>24}{'step ms':>9}"
            f"{'required MB':>13}{'effective MB':>14}{'eff/req':>9}{'all-experts MB':>16}"
            f"{'saving':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        experts = "/".join(f"{n:.1f}" for n in r.active_experts_mean)
        lines.append(f"{r.model:<13}{r.batch:>6}{r.top_k:>6} {experts:>24}{r.step_ms:>9.2f}"
                     f"{r.required_bytes / 1e6:>13.1f}{r.effective_bytes / 1e6:>14.1f}"
                     f"{r.ratio:>9.2f}{r.dense_equivalent_bytes / 1e6:>16.1f}"
                     f"{r.saving:>7.1f}x")
    return "\n".join(lines)


def main(s: MoeBenchSettings, as_json: bool) -> int:
    rows = run_bench(s, lambda msg: print(msg, file=sys.stderr, flush=True))
    if as_json:
        for r in rows:
            print(json.dumps({"kind": "moe_decode"} | asdict(r) | {
                "effective_bytes": round(r.effective_bytes), "ratio": round(r.ratio, 3),
                "saving": round(r.saving, 2)}))
    else:
        print(format_table(rows))
    return 0
