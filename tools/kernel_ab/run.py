"""Times a compiled operator of two revisions of `kernels/csrc` in one process: the base
revision's sources and the working tree's, each compiled with its `pdserve` namespace renamed
(`pdserve_base`, `pdserve_head`) into one extension, called in rounds of random order; prints
the median over the rounds of base time / head time with its quartiles, and whether the two
give the same bits.

Why one process: on a shared VM whose speed moves by 2x within minutes, two builds timed in
alternating processes differ by more than most kernel changes (a 15% attention change read
0.8-1.5x run by run); and the engine's own build cannot be loaded twice in one process (torch
loads extensions RTLD_GLOBAL: the second build's symbols resolve to the first's).

    .venv/bin/python tools/kernel_ab/run.py --base HEAD~1 attention --lengths 512,2048
    .venv/bin/python tools/kernel_ab/run.py --base HEAD~1 linear --shapes 2048x576x3072
    .venv/bin/python tools/kernel_ab/run.py --base HEAD~1 ops --rows 1500

Builds every source twice (about a minute on 2 cores) into a temporary folder; the base
revision needs the working tree's source files (`kernels.SOURCES`) and the timed operators.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import random
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from pdserve.bench.timing import fastest_seconds
from pdserve.engine.kernels import CSRC, SOURCES, compile_flags, cpu_ops
from pdserve.engine.model.packed_linear import linear_kernel

REPO = CSRC.parents[4]
OPS = ("prefill_attention", "amx_pack", "amx_linear", "dpbf16_pack", "dpbf16_linear",
       "avx2_pack", "avx2_linear", "rms_norm", "add_rms_norm", "silu_mul", "rope_")
DECLARATIONS = {  # ops.h's declarations of them (its two copies cannot both be included: GCC
    # takes identical files for one under #pragma once)
    "prefill_attention": "at::Tensor {}(const at::Tensor&, const at::Tensor&, const at::Tensor&, "
                         "const at::Tensor&, int64_t, double)",
    "pack": "at::Tensor {}(const at::Tensor&)",
    "linear": "at::Tensor {}(const at::Tensor&, const at::Tensor&, "
              "const std::optional<at::Tensor>&)",
    "rms_norm": "at::Tensor {}(const at::Tensor&, const at::Tensor&, double)",
    "add_rms_norm": "std::tuple<at::Tensor, at::Tensor> {}(const at::Tensor&, const at::Tensor&, "
                    "const at::Tensor&, double)",
    "silu_mul": "at::Tensor {}(const at::Tensor&)",
    "rope_": "void {}(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, "
             "int64_t, int64_t)",
}


def export(rev: str | None, into: Path) -> None:
    """csrc at git revision `rev` (None: the working tree) into the folder `into`."""
    into.mkdir()
    rel = CSRC.relative_to(REPO)
    names = subprocess.run(["git", "-C", str(REPO), "ls-files", str(rel)], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        text = ((REPO / name).read_text() if rev is None else subprocess.run(
            ["git", "-C", str(REPO), "show", f"{rev}:{name}"], check=True,
            capture_output=True, text=True).stdout)
        (into / Path(name).name).write_text(text)


def module_source(tags: tuple[str, ...]) -> str:
    kinds = {op: op if op in DECLARATIONS else op.split("_")[-1] for op in OPS}
    lines = ["#include <torch/extension.h>"]
    for tag in tags:
        lines += [f"namespace pdserve_{tag} {{",
                  *(DECLARATIONS[kinds[op]].format(op) + ";" for op in OPS), "}"]
    lines.append("PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {")
    lines += [f'  m.def("{tag}_{op}", &pdserve_{tag}::{op});' for tag in tags for op in OPS]
    lines.append("}")
    return "\n".join(lines) + "\n"


def build(base: str, folder: Path):
    export(base, folder / "base")
    export(None, folder / "head")
    units = []
    for tag in ("base", "head"):
        for source in SOURCES:
            if source == "bindings.cpp":
                continue
            unit = folder / f"{tag}_{source}"
            unit.write_text(f'#define pdserve pdserve_{tag}\n#include "{tag}/{source}"\n')
            units.append(str(unit))
    (folder / "module.cpp").write_text(module_source(("base", "head")))
    return load(name="kernel_ab", sources=[str(folder / "module.cpp"), *units],
                extra_cflags=compile_flags(), extra_ldflags=["-fopenmp"],
                build_directory=str(folder), verbose=False)


def same_bits(base: object, head: object) -> str:
    """Whether two calls' results are bit for bit the same (a change meant to be exact is)."""
    if base is None:  # an operator in place: the two calls saw different inputs
        return ""
    pairs = list(zip(base, head, strict=True)) if isinstance(base, tuple) else [(base, head)]
    if all(torch.equal(a, b) for a, b in pairs):
        return ", same bits"
    worst = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
    return f", bits differ (max |head - base| {worst:.3g})"


def compare(name: str, base: Callable[[], object], head: Callable[[], object],
            rounds: int) -> None:
    bits = same_bits(base(), head())
    ratios = []
    for _ in range(rounds):
        sides = [("base", base), ("head", head)]
        random.shuffle(sides)
        t = {side: fastest_seconds(fn, 3) for side, fn in sides}
        ratios.append(t["base"] / t["head"])
    q = statistics.quantiles(ratios, n=4)
    print(f"{name:28s} head speed / base: {statistics.median(ratios):.3f} "
          f"(quartiles {q[0]:.3f}-{q[2]:.3f}, {rounds} rounds{bits})", flush=True)


def attention(ab, lengths: list[int], cached: int, shape: tuple[int, int, int],
              rounds: int) -> None:
    heads, kv_heads, d = shape
    block = 16
    for n in lengths:
        gen = torch.Generator().manual_seed(n)
        blocks = -(-(cached + n) // block)
        k = torch.randn(blocks, block, kv_heads, d, generator=gen).bfloat16()
        v = torch.randn(blocks, block, kv_heads, d, generator=gen).bfloat16()
        table = torch.randperm(blocks, generator=gen)
        q = torch.randn(n, heads, d, generator=gen).bfloat16()
        args = (q, k, v, table, cached + n, d ** -0.5)
        name = f"prefill_attention n={n}" + (f" after {cached}" if cached else "")
        compare(name, functools.partial(ab.base_prefill_attention, *args),
                functools.partial(ab.head_prefill_attention, *args), rounds)


def linear(ab, shapes: list[tuple[int, int, int]], rounds: int, cold_mb: int) -> None:
    """With `cold_mb`, each call takes the next of as many copies of the weight as fill that
    many MB, round robin: the weight comes from memory, as a model's layers do in the engine
    (SmolLM2's 270 MB pass through the caches once a step)."""
    kernel = linear_kernel(cpu_ops()).run.__name__.removesuffix("_linear")  # the engine's
    for m, k, n in shapes:
        gen = torch.Generator().manual_seed(m + n)
        x = torch.randn(m, k, generator=gen).bfloat16()
        w = (torch.randn(n, k, generator=gen) * k ** -0.5).bfloat16()
        copies = max(1, -(-cold_mb * 2 ** 20 // (2 * n * k)))
        base, head = (_rotating(getattr(ab, f"{tag}_{kernel}_linear"), x,
                                [getattr(ab, f"{tag}_{kernel}_pack")(w) for _ in range(copies)])
                      for tag in ("base", "head"))
        cold = f", weights cold ({copies} copies)" if cold_mb else ""
        compare(f"{kernel}_linear {m}x{k}x{n}{cold}", base, head, rounds)


def _rotating(run: Callable, x: torch.Tensor, weights: list[torch.Tensor]) -> Callable[[], object]:
    """run(x, w, None) for the next of `weights` at each call."""
    turn = itertools.cycle(weights)
    return lambda: run(x, next(turn), None)


def elementwise(ab, rows: list[int], shape: tuple[int, int, int, int, int],
                rounds: int) -> None:
    """The operators between a layer's linears, on `rows` rows of a model's widths."""
    hidden, inter, heads, kv_heads, d = shape
    for m in rows:
        gen = torch.Generator().manual_seed(m)
        x, res = (torch.randn(m, hidden, generator=gen).bfloat16() for _ in range(2))
        w = (1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16()
        gate_up = torch.randn(m, 2 * inter, generator=gen).bfloat16()
        qkv = torch.randn(m, (heads + 2 * kv_heads) * d, generator=gen).bfloat16()
        angle = torch.arange(m).float()[:, None] * torch.rand(d, generator=gen)
        positions = torch.arange(m)
        calls = {"rms_norm": (x, w, 1e-5), "add_rms_norm": (x, res, w, 1e-5),
                 "silu_mul": (gate_up,),
                 "rope_": (qkv, positions, angle.cos(), angle.sin(), heads + kv_heads, d)}
        for op, args in calls.items():
            compare(f"{op} rows={m}", functools.partial(getattr(ab, f"base_{op}"), *args),
                    functools.partial(getattr(ab, f"head_{op}"), *args), rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision to compare the working "
                                                        "tree's kernels with (default: HEAD)")
    parser.add_argument("--rounds", type=int, default=15)
    sub = parser.add_subparsers(dest="op", required=True)
    att = sub.add_parser("attention", help="prefill_attention")
    att.add_argument("--lengths", default="512,1000,2048,4096")
    att.add_argument("--cached", type=int, default=0,
                     help="context positions before the prompt (default: 0)")
    att.add_argument("--shape", default="9,3,64",
                     help="heads,kv_heads,head_dim (default: 9,3,64, SmolLM2-135M)")
    lin = sub.add_parser("linear", help="the CPU's linear kernel, M x K x N")
    lin.add_argument("--shapes", default="2048x576x3072,2048x576x960,2048x1536x576,32x576x3072")
    lin.add_argument("--cold-mb", type=int, default=0,
                     help="rotate over copies of the weight filling this many MB, more than "
                          "the caches hold, so that each call reads its weight from memory "
                          "(default: 0, one copy, warm in the caches)")
    ew = sub.add_parser("ops", help="rms_norm, add_rms_norm, silu_mul and rope_")
    ew.add_argument("--rows", default="1500,32")
    ew.add_argument("--shape", default="576,1536,9,3,64",
                    help="hidden,intermediate,heads,kv_heads,head_dim (default: SmolLM2-135M)")
    args = parser.parse_args()
    if cpu_ops() is None:
        raise SystemExit("the compiled operators do not build here")
    with tempfile.TemporaryDirectory() as folder:
        ab = build(args.base, Path(folder))
        if args.op == "attention":
            shape = tuple(int(v) for v in args.shape.split(","))
            attention(ab, [int(n) for n in args.lengths.split(",")], args.cached, shape,
                      args.rounds)
        elif args.op == "ops":
            elementwise(ab, [int(n) for n in args.rows.split(",")],
                        tuple(int(v) for v in args.shape.split(",")), args.rounds)
        else:
            linear(ab, [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")],
                   args.rounds, args.cold_mb)


if __name__ == "__main__":
    main()
