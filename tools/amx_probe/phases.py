"""Whether this machine is in a slow phase for AMX tile loads: alternates pdserve's linear
inner loop (2 A + 2 B tile loads, 4 TDPBF16PS) with the same products without the loads, on
one thread for --seconds, and prints each one's nanoseconds per product (percentiles of
~2 ms samples), the ratio of the two in each pair, and the share of pairs where the loads
made the loop more than --slow times slower than its products alone. On a shared 2-vCPU Xeon
both read 6.0 ns at the median, but 17% of the pairs were slow (p90 23.9 ns with the loads,
14.6 without), a second at a time: kernel timings there are only comparable within one
process (`tools/kernel_ab`). Needs an AMX CPU and a compiler; builds into a temporary folder.

    .venv/bin/python tools/amx_probe/phases.py [--seconds 20] [--slow 1.5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from torch.utils.cpp_extension import load

from pdserve.engine.kernels import CSRC

ITERATIONS = 100  # a call: 400 products, ~3-10 us
PER_PAIR = 200  # calls per side of a pair, timed as their median: ~1-4 ms a side


def percentiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=10)
    return f"p10 {q[0]:6.2f}  p50 {statistics.median(values):6.2f}  p90 {q[-1]:6.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--slow", type=float, default=1.5,
                        help="kernel / products ratio above which a pair counts as slow")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as build:
        ext = load(name="amx_phases", sources=[str(Path(__file__).parent / "phases.cpp")],
                   build_directory=build, extra_include_paths=[str(CSRC)],
                   extra_cflags=["-O2", "-march=native"])
        products: list[float] = []
        kernel: list[float] = []
        seconds: list[tuple[float, float]] = []  # (time into the run, ratio) per pair
        start = time.perf_counter()
        while (now := time.perf_counter() - start) < args.seconds:
            p = statistics.median(ext.run(ITERATIONS, 0) for _ in range(PER_PAIR))
            k = statistics.median(ext.run(ITERATIONS, 1) for _ in range(PER_PAIR))
            products.append(p)
            kernel.append(k)
            seconds.append((now, k / p))
    ratios = [r for _, r in seconds]
    slow = sum(r > args.slow for r in ratios)
    print(f"{len(ratios)} pairs over {args.seconds:.0f} s, ns per TDPBF16PS:")
    print(f"  products alone      {percentiles(products)}")
    print(f"  with tile loads     {percentiles(kernel)}")
    print(f"  ratio per pair      {percentiles(ratios)}")
    share = 100 * slow / len(ratios)
    print(f"  slow pairs (ratio > {args.slow}): {slow} of {len(ratios)} ({share:.0f}%)")
    by_second: dict[int, list[float]] = {}
    for at, r in seconds:
        by_second.setdefault(int(at), []).append(r)
    print("  median ratio per second: " + " ".join(
        f"{statistics.median(v):.1f}" for _, v in sorted(by_second.items())))


if __name__ == "__main__":
    main()
