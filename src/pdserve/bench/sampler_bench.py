"""`pdserve bench sampler`: what drawing the next tokens costs a decode step, per way of drawing.

For a batch of B rows of V logits (a decode step's; SmolLM2's vocabulary unless told), the
engine's `Sampler` on this process's threads, each way timed in the same rounds:
- greedy: the first argmax (temperature 0);
- unseeded: temperature 1, one uniform per row and the inverse CDF, by the compiled
  `sample_rows` where the fused CPU operators are built (one pass over each row);
- unseeded-ops: the same draw by PyTorch's operators (softmax, cumsum, searchsorted:
  `sampler.inverse_cdf`), the path without the compiled operators: the baseline of the
  compiled draw;
- seeded: temperature 1 with a seed, the exponential race (one uniform per vocabulary entry,
  from a generator seeded per row and position): also what every sampled row cost before
  unseeded rows took the inverse CDF;
- top-p: temperature 0.7, top-p 0.9, unseeded (the nucleus, then the inverse CDF), compiled
  where the operators are built (the nucleus found in a pool of the largest logits);
- top-p-ops: the same by PyTorch's operators (`sampler.apply_top_p`, then `inverse_cdf`).
The rows' logits are random normal times `--scale` (a flatter or more peaked distribution;
top-p's cost grows with the nucleus). Each round times every way (`repeats` calls each, in a
random order) and a row reports the medians over the rounds, and three ratios per round, then
their medians: the seeded race's time over the unseeded draw's, and the unseeded and the top-p
draws' by PyTorch's operators over the compiled ones'.

The operators' [B, V] fp32 temporaries (3 MiB at 16 rows) are where the allocator state
matters: in a fresh process glibc maps and unmaps each one, and its page faults made the
operators' draw cost 4x what it costs in a worker, whose heap has grown past them (16 rows:
5.6 ms against 1.3-1.5 ms with a model loaded). So the command first has glibc keep blocks
up to 64 MiB on the heap (`steady_allocator`), as in a long-running engine process.
"""

from __future__ import annotations

import ctypes
import json
import random
import statistics
import sys
from dataclasses import asdict, dataclass

import torch

from pdserve.bench.timing import median_seconds
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.kernels import cpu_ops
from pdserve.engine.sampler import Sampler

# A way named "-ops" is drawn by a Sampler without the compiled operators.
WAYS = {
    "greedy": SamplingParams(temperature=0.0),
    "unseeded": SamplingParams(temperature=1.0),
    "unseeded-ops": SamplingParams(temperature=1.0),
    "seeded": SamplingParams(temperature=1.0, seed=7),
    "top-p": SamplingParams(temperature=0.7, top_p=0.9),
    "top-p-ops": SamplingParams(temperature=0.7, top_p=0.9),
}


@dataclass(frozen=True)
class SamplerSettings:
    batches: tuple[int, ...] = (1, 16, 64)
    vocab: int = 49152  # SmolLM2's
    scale: float = 3.0
    repeats: int = 5
    rounds: int = 7

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) <= 0:
            raise ValueError("batch sizes must be positive integers")
        for name in ("vocab", "repeats", "rounds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")


@dataclass(frozen=True)
class SamplerRow:
    batch: int
    ms: dict[str, float]  # way -> median milliseconds over the rounds
    race_over_inverse: float  # median over the rounds of seeded ms / unseeded ms
    ops_over_compiled: float  # median over the rounds of unseeded-ops ms / unseeded ms
    top_p_ops_over_compiled: float  # likewise, top-p-ops ms / top-p ms


def measure(batch: int, s: SamplerSettings) -> SamplerRow:
    gen = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, s.vocab, generator=gen) * s.scale).bfloat16()  # [B, V]
    samplers = {way: Sampler(seed=1, fused=None if way.endswith("-ops") else cpu_ops())
                for way in WAYS}
    positions = list(range(batch))
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(s.rounds):
        ways = list(WAYS.items())
        random.shuffle(ways)
        for way, params in ways:
            times[way].append(median_seconds(
                lambda w=way, p=params: samplers[w](logits, [p] * batch, positions),
                s.repeats))
    return SamplerRow(batch, {w: statistics.median(t) * 1e3 for w, t in times.items()},
                      _median_ratio(times["seeded"], times["unseeded"]),
                      _median_ratio(times["unseeded-ops"], times["unseeded"]),
                      _median_ratio(times["top-p-ops"], times["top-p"]))


def _median_ratio(over: list[float], under: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(over, under, strict=True))


def format_table(rows: list[SamplerRow]) -> str:
    head = (f"{'batch':>6}" + "".join(f"{w + ' ms':>{_width(w)}}" for w in WAYS)
            + f"{'race / inverse':>16}{'ops / compiled':>16}{'top-p ops / compiled':>22}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.batch:>6}" + "".join(f"{r.ms[w]:>{_width(w)}.3f}" for w in WAYS)
                     + f"{r.race_over_inverse:>15.2f}x{r.ops_over_compiled:>15.2f}x"
                     + f"{r.top_p_ops_over_compiled:>21.2f}x")
    return "\n".join(lines)


def _width(way: str) -> int:
    return max(13, len(way) + 5)


def steady_allocator() -> None:
    """glibc: serve allocations up to 64 MiB from the heap and trim it only past 128 MiB free
    (mallopt M_MMAP_THRESHOLD, M_TRIM_THRESHOLD); nothing where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 128 << 20)  # M_TRIM_THRESHOLD


def main(s: SamplerSettings, as_json: bool) -> int:
    steady_allocator()
    print(f"sampling {s.vocab}-entry rows of bf16 logits (normal x {s.scale}), "
          f"{torch.get_num_threads()} threads, medians of {s.rounds} rounds of {s.repeats}",
          file=sys.stderr)
    rows = [measure(b, s) for b in s.batches]
    if as_json:
        for r in rows:
            print(json.dumps(asdict(r)))
    else:
        print(format_table(rows))
    return 0
