"""`pdserve bench decode-context`: what one context token costs a decode step, alone and shared.

A decode step's time grows with the context its streams attend to: `pdserve simulate` prices
it as per_context_token x the summed context (planner/simulate/step_fit.py), and a serving
run whose long contexts all come in large batches cannot tell that cost from the per-stream
one (`simulate --decode-context-us` holds it at a value measured apart: this one). For each
batch B, three decode batches of B streams are timed, each the median step of `steps` after
all B prompts are in, median of `repeats` runs:

- short: every stream's prompt `own` tokens (the baseline, measured in the same run);
- unique: every stream's prompt `context` tokens, none shared;
- shared: every stream's prompt the same `context - own` tokens (a prefix, served from the
  prefix cache to all but the first) and `own` tokens of its own.

    per context token = (unique - short) / (B x (context - own))
    shared / unique    = (shared - short) / (unique - short)

The second says what a shared prefix's tokens cost against unique ones: 1 if every stream
pays for the blocks it reads, 1 / B if the shared blocks cost once per step (they stay in the
CPU's caches between the streams that read them).

The engine steps alone are timed (no worker, no HTTP), so the per-stream overhead of serving
is not in them; the per-token slope is what a calibration needs. `threads` sets the engine's
compute threads: a worker of `pdserve up` computes on its share of the cores (a disaggregated
pair on two cores: one each), and one thread pays two to three times per token what two do.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from pdserve.bench.engine_bench import RandomPrompts
from pdserve.common.model_config import ModelConfig
from pdserve.common.model_folder import resolve_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine

WARM_STEPS = 3  # steps after the last prompt before timing: its own step is not a decode step


@dataclass(frozen=True)
class ContextSettings:
    model: str = "smollm2"
    batches: tuple[int, ...] = (4, 8)
    context: int = 1360  # tokens per stream in the unique and shared batches
    own: int = 352  # tokens of its own per stream (the short batch's whole prompt)
    steps: int = 40
    repeats: int = 3
    dtype: str = "auto"
    threads: int | None = None  # the engine's compute threads; None: PyTorch's default

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 2:
            raise ValueError(f"batches must be integers >= 2 (a prefix is shared by two "
                             f"streams at least), got {self.batches}")
        if not 0 < self.own < self.context:
            raise ValueError(f"own ({self.own}) must be positive and under context "
                             f"({self.context})")
        for name in ("steps", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads must be positive, got {self.threads}")


@dataclass(frozen=True)
class ContextRow:
    batch: int
    short_ms: float
    unique_ms: float
    shared_ms: float
    context_tokens: int  # per stream, unique and shared
    own_tokens: int  # per stream: the short batch's, and the shared batch's own part

    @property
    def per_context_token_us(self) -> float:
        extra = self.batch * (self.context_tokens - self.own_tokens)
        return (self.unique_ms - self.short_ms) / extra * 1e3

    @property
    def shared_over_unique(self) -> float:
        return (self.shared_ms - self.short_ms) / (self.unique_ms - self.short_ms)


def decode_step_times(engine: Engine, prompts: list[list[int]], steps: int,
                      warm_steps: int = WARM_STEPS) -> list[float]:
    """Seconds of each of `steps` decode steps of the streams `prompts` start, after each is
    prefilled (one after the other, so later prompts find the earlier ones' blocks in the
    prefix cache) and `warm_steps` more (first-use costs); the streams are aborted after."""
    params = SamplingParams(temperature=0, max_tokens=warm_steps + steps + 1, ignore_eos=True)
    ids = []
    for p in prompts:
        ids.append(engine.add_request(p, params))
        while engine.requests[ids[-1]].num_output_tokens == 0:
            engine.step()
    for _ in range(warm_steps):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for r in ids:
        engine.abort(r)
    return times


def _median_step_ms(engine: Engine, prompts: list[list[int]], steps: int) -> float:
    """The median decode step of the streams `prompts` start (`decode_step_times`), in ms."""
    return statistics.median(decode_step_times(engine, prompts, steps)) * 1e3


def _row(engine: Engine, prompts: RandomPrompts, batch: int, s: ContextSettings
         ) -> ContextRow:
    def tokens(n: int) -> list[int]:
        return prompts(1, n)[0]

    def timed(kind: str) -> float:
        runs = []
        for _ in range(s.repeats):
            if kind == "short":
                prompts = [tokens(s.own) for _ in range(batch)]
            elif kind == "unique":
                prompts = [tokens(s.context) for _ in range(batch)]
            else:
                prefix = tokens(s.context - s.own)
                prompts = [prefix + tokens(s.own) for _ in range(batch)]
            runs.append(_median_step_ms(engine, prompts, s.steps))
        return statistics.median(runs)

    return ContextRow(batch, timed("short"), timed("unique"), timed("shared"), s.context, s.own)


def run_bench(s: ContextSettings) -> list[ContextRow]:
    if s.threads is not None:
        torch.set_num_threads(s.threads)
    cfg = ModelConfig.from_folder(resolve_model(s.model))
    need = s.context + WARM_STEPS + s.steps + 2
    if need > cfg.max_context:
        raise ValueError(f"context ({s.context}) + {WARM_STEPS + s.steps + 2} decoded tokens "
                         f"exceed {s.model}'s {cfg.max_context} positions")
    engine = Engine(EngineConfig(model=s.model, dtype=s.dtype, max_model_len=need,
                                 kv_cache_bytes=_kv_bytes(cfg, s, need)))
    prompts = RandomPrompts(cfg.vocab_size)
    return [_row(engine, prompts, b, s) for b in s.batches]


def _kv_bytes(cfg: ModelConfig, s: ContextSettings, need: int) -> int:
    """A pool for the largest batch's streams at full length, twice over (aborted requests'
    blocks stay cached, evicted as needed), at least the engine's default."""
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # fp32: an upper bound
    return max(512 * 2**20, 2 * max(s.batches) * need * per_token)


def format_table(rows: list[ContextRow]) -> str:
    head = (f"{'batch':>6}{'short ms':>10}{'unique ms':>11}{'shared ms':>11}"
            f"{'us / context token':>20}{'shared / unique':>17}")
    lines = [head, "-" * len(head)]
    lines += [f"{r.batch:>6}{r.short_ms:>10.2f}{r.unique_ms:>11.2f}{r.shared_ms:>11.2f}"
              f"{r.per_context_token_us:>20.3f}{r.shared_over_unique:>17.2f}" for r in rows]
    return "\n".join(lines)


def main(s: ContextSettings, as_json: bool) -> int:
    print(f"decode steps of {s.model}: B streams of {s.own} tokens (short), {s.context} "
          f"(unique), and {s.context - s.own} shared + {s.own} own (shared); medians of "
          f"{s.repeats} runs of {s.steps} steps", file=sys.stderr, flush=True)
    rows = run_bench(s)
    print(f"on {torch.get_num_threads()} threads", file=sys.stderr, flush=True)
    if as_json:
        for r in rows:
            print(json.dumps(asdict(r) | {
                "per_context_token_us": round(r.per_context_token_us, 4),
                "shared_over_unique": round(r.shared_over_unique, 3)}))
    else:
        print(format_table(rows))
    return 0
