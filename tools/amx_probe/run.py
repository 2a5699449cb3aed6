"""Streams a buffer the size of SmolLM2's decode weights (270 MB, on huge pages as the engine's
are) through the AMX tile loop in several ways and prints GB/s and the ratio to a plain
AVX-512 read in the same run (stream.cpp says what each mode does). Medians of --repeats,
modes interleaved. Needs an AMX CPU and a compiler; builds into a temporary folder.

    .venv/bin/python tools/amx_probe/run.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from pdserve.engine import huge_pages
from pdserve.engine.kernels import CSRC

MODES = ("avx_read", "tile_loads", "tile_loads_pf", "m1_kernel", "m32_kernel", "m32_pf",
         "m32_hot")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    here = Path(__file__).parent
    with tempfile.TemporaryDirectory() as build:
        ext = load(name="amx_probe", sources=[str(here / "stream.cpp")], build_directory=build,
                   extra_include_paths=[str(CSRC)],
                   extra_cflags=["-O3", "-march=native", "-fopenmp"],
                   extra_ldflags=["-fopenmp"])
        # 270 MB of "weights" (+ 2 KiB the prefetching modes may touch past the end)
        w = huge_pages.zeros((135 * 2**20 + 1024,), torch.bfloat16).normal_()
        w = w[: 135 * 2**20]
        x = torch.randn(32, 576, dtype=torch.bfloat16)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(args.repeats):
            for i, mode in enumerate(MODES):
                times[mode].append(ext.run(w, x, i))
    nbytes = w.numel() * 2
    base = statistics.median(times["avx_read"])
    print(f"{'mode':<14}{'ms':>8}{'GB/s':>8}{'vs avx_read':>13}")
    for mode in MODES:
        t = statistics.median(times[mode])
        print(f"{mode:<14}{1e3 * t:>8.2f}{nbytes / t / 1e9:>8.1f}{base / t:>12.2f}x")


if __name__ == "__main__":
    main()
