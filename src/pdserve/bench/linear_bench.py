"""`pdserve bench linear`: pdserve's bf16 linear kernel beside oneDNN's, on a model's layer shapes.

For each row count T (1 is a batch-1 decode step, a few thousand a long prompt) and each of a
decoder layer's linears (qkv, o, gate_up, down; SmolLM2-135M's shapes unless told), in bf16 on
this process's threads:
- pdserve: the kernel the engine takes on this CPU (`packed_linear.linear_kernel`: AMX tiles,
  VDPBF16PS or fp32 FMAs), on its packed weight;
- oneDNN: the same weight reordered once into oneDNN's blocked layout (`PackedLinear`, what the
  engine runs where it has no kernel of its own, and faster than `F.linear`).
The two sides alternate in rounds (each round: `repeats` calls of one, then of the other) and
a row reports the medians over the rounds, the speed-up that of each round's ratio: on a
shared machine whose speed moves by 2x within minutes, a round's two sides see the same
machine. GFLOP/s = 2 T x in x out / time.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass

import torch
from torch import nn

from pdserve.bench.timing import median_seconds
from pdserve.engine.kernels import cpu_ops
from pdserve.engine.model.packed_linear import LinearKernel, PackedLinear, linear_kernel


@dataclass(frozen=True)
class LinearRow:
    rows: int
    name: str
    in_features: int
    out_features: int
    pdserve_ms: float
    onednn_ms: float
    speedup: float  # median over the rounds of oneDNN's time / pdserve's in the same round

    @property
    def flops(self) -> float:
        return 2.0 * self.rows * self.in_features * self.out_features


@dataclass(frozen=True)
class LinearSettings:
    rows: tuple[int, ...] = (1, 32, 512, 1000, 2048)
    hidden: int = 576  # SmolLM2-135M's shape
    intermediate: int = 1536
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    repeats: int = 5
    rounds: int = 5

    def __post_init__(self) -> None:
        if not self.rows or min(self.rows) <= 0:
            raise ValueError("row counts must be positive integers")
        for name in ("hidden", "intermediate", "heads", "kv_heads", "head_dim", "repeats",
                     "rounds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def layers(self) -> list[tuple[str, int, int]]:
        """A decoder layer's linears: (name, in_features, out_features)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [("qkv", self.hidden, q + 2 * kv), ("o", q, self.hidden),
                ("gate_up", self.hidden, 2 * self.intermediate),
                ("down", self.intermediate, self.hidden)]


def measure(kernel: LinearKernel, rows: int, name: str, n_in: int, n_out: int,
            s: LinearSettings) -> LinearRow:
    gen = torch.Generator().manual_seed(rows * 7919 + n_out)
    layer = nn.Linear(n_in, n_out, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, n_in, generator=gen) * n_in ** -0.5)
    x = torch.randn(rows, n_in, generator=gen).to(torch.bfloat16)
    if not kernel.fits(layer):
        raise ValueError(f"{name} ({n_in} -> {n_out}) does not fit the {kernel.name} kernel: "
                         f"it takes out features in multiples of {kernel.out_multiple} and in "
                         f"features of {kernel.in_multiple}")
    packed = kernel.pack(layer.weight.detach())
    onednn = PackedLinear(layer)
    ours, theirs = [], []
    with torch.inference_mode():
        for _ in range(s.rounds):
            ours.append(median_seconds(lambda: kernel.run(x, packed, None), s.repeats))
            theirs.append(median_seconds(lambda: onednn(x), s.repeats))
    return LinearRow(rows, name, n_in, n_out, statistics.median(ours) * 1e3,
                     statistics.median(theirs) * 1e3,
                     statistics.median(b / a for a, b in zip(ours, theirs, strict=True)))


def format_table(rows: list[LinearRow]) -> str:
    head = (f"{'rows':>6} {'linear':<8}{'in x out':>12}{'pdserve ms':>12}{'GFLOP/s':>9}"
            f"{'oneDNN ms':>11}{'GFLOP/s':>9}{'x oneDNN':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.rows:>6} {r.name:<8}{f'{r.in_features}x{r.out_features}':>12}"
                     f"{r.pdserve_ms:>12.3f}{r.flops / r.pdserve_ms / 1e6:>9.0f}"
                     f"{r.onednn_ms:>11.3f}{r.flops / r.onednn_ms / 1e6:>9.0f}"
                     f"{r.speedup:>10.2f}")
    return "\n".join(lines)


def main(s: LinearSettings, as_json: bool) -> int:
    kernel = linear_kernel(cpu_ops())
    if kernel is None or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        print("pdserve bench linear: needs one of pdserve's bf16 linear kernels (AMX, "
              "AVX512-BF16, or AVX2 and FMA, and a C++ compiler) and oneDNN's bf16 path on "
              "this CPU", file=sys.stderr)
        return 1
    print(f"pdserve's linear on {kernel.name} vs oneDNN (prepacked), bf16, "
          f"{torch.get_num_threads()} threads, medians of {s.rounds} rounds of {s.repeats}",
          file=sys.stderr)
    rows = [measure(kernel, t, name, n_in, n_out, s)
            for t in s.rows for name, n_in, n_out in s.layers()]
    if as_json:
        for r in rows:
            print(json.dumps(asdict(r)))
    else:
        print(format_table(rows))
    return 0
