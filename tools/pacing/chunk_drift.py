"""Where in their prompts the paced chunks of a measured run ran long: the steps that computed
prompt tokens beside streams, from a `pdserve bench compare --out X.json` run's step rows
(X.steps.json), grouped by how far into its prompt each chunk started, with their median and
99th percentile durations and the share over the TPOT target. Chunks sized by one average rate
(`workers/prefill_budget.py`) run longer late in a prompt, whose tokens attend to every
position before them, than early in it.

A step's position comes from its row: P = N x c + N (N + 1) / 2 attended pairs for N prompt
tokens after c computed ones, so c = (P - N (N + 1) / 2) / N (exact for a step of one prompt;
a step that carried two prompts is counted at their mean).

    .venv/bin/python tools/pacing/chunk_drift.py X.steps.json [--config elastic] [--tpot-ms 100]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

EDGES = (0, 256, 512, 1024, 2048)  # chunk start positions: the groups' lower bounds


def position(row: list[float]) -> float:
    """c above for a step row [start, end, prefill, decode, requests, context, pairs]."""
    n, pairs = row[2], row[6]
    return (pairs - n * (n + 1) / 2) / n


def groups(rows: list[list[float]]) -> dict[int, list[float]]:
    """Durations (ms) of the steps with prompt tokens and decodes, by EDGES group."""
    out: dict[int, list[float]] = {}
    for row in rows:
        if row[2] and row[3] and len(row) > 6:
            edge = max(e for e in EDGES if e <= position(row))
            out.setdefault(edge, []).append((row[1] - row[0]) * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("steps", help="a bench compare run's .steps.json")
    p.add_argument("--config", default="elastic", help="its configuration (default: elastic)")
    p.add_argument("--tpot-ms", type=float, default=100.0, help="the target (default: 100)")
    args = p.parse_args()
    workers = json.loads(Path(args.steps).read_text())[args.config]
    for worker, rows in workers.items():
        for edge, ms in sorted(groups(rows).items()):
            ms.sort()
            p99 = ms[math.ceil(0.99 * len(ms)) - 1]
            over = sum(m > args.tpot_ms for m in ms) / len(ms)
            print(f"{worker}: chunks from {edge:>5} computed tokens: {len(ms):>4} steps, median "
                  f"{statistics.median(ms):4.0f} ms, P99 {p99:4.0f} ms, {over:4.0%} over "
                  f"{args.tpot_ms:g} ms")


if __name__ == "__main__":
    main()
