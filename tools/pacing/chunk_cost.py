"""What a paced chunk costs beyond its share of a whole prompt: a least-squares fit of the steps
that computed prompt tokens beside streams in a `pdserve bench compare --out X.json` run's step
rows (X.steps.json),

    t = a + b x N + c x P + e x D

N the step's prompt tokens, P its attended pairs (each prompt token attends to every position
before it and itself), D the streams it decoded; a is then what every step pays whatever it
computes (reading the weights, the step's own overhead), e a stream's decode. The fit predicts a
whole prompt of the run's most common length in one step with no stream (a + b N + c N (N+1)/2)
and prints it beside the steps that did exactly that, where the run has any: where the two
agree, chunks compute their tokens as fast as a whole prompt does, and a prompt in k chunks
pays k - 1 more steps' a and its streams' decodes.

    .venv/bin/python tools/pacing/chunk_cost.py X.steps.json [--config elastic]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path

import numpy as np

NAMES = ("a (ms a step)", "b (ms a prompt token)", "c (ms per 1,000 attended pairs)",
         "e (ms a stream)")


def fit(rows: list[list[float]]) -> tuple[np.ndarray, float, int]:
    """(a, b, c, e) in ms, the residuals' RMS in ms and the steps fitted, from the rows [start,
    end, prefill, decode, requests, context, pairs] that computed prompt tokens and decoded;
    ValueError with fewer steps than coefficients."""
    chunks = [r for r in rows if r[2] and r[3] and len(r) > 6]
    if len(chunks) < len(NAMES):
        raise ValueError(f"{len(chunks)} prompt steps beside streams: too few to fit "
                         f"{len(NAMES)} coefficients")
    x = np.array([[1.0, r[2], r[6] / 1e3, r[3]] for r in chunks])  # [steps, 4]
    y = np.array([(r[1] - r[0]) * 1e3 for r in chunks])  # [steps] ms
    coef = np.linalg.lstsq(x, y, rcond=None)[0]  # [4]
    rms = float(np.sqrt(np.mean((x @ coef - y) ** 2)))
    return coef, rms, len(chunks)


def whole(rows: list[list[float]]) -> tuple[int, list[float]] | None:
    """The most common length of the prompts computed in one step with no stream, and those
    steps' durations in ms; None when the run has none."""
    alone = [r for r in rows if r[2] and not r[3]]
    if not alone:
        return None
    n = Counter(int(r[2]) for r in alone).most_common(1)[0][0]
    return n, [(r[1] - r[0]) * 1e3 for r in alone if r[2] == n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("steps", help="a bench compare run's .steps.json")
    p.add_argument("--config", default="elastic", help="its configuration (default: elastic)")
    args = p.parse_args()
    workers = json.loads(Path(args.steps).read_text())[args.config]
    for worker, rows in workers.items():
        try:
            coef, rms, count = fit(rows)
        except ValueError as e:
            print(f"{worker}: {e}")
            continue
        terms = ", ".join(f"{name} {value:.3f}" for name, value in zip(NAMES, coef, strict=True))
        print(f"{worker}: {count} prompt steps beside streams: {terms}; residual RMS {rms:.1f} ms")
        alone = whole(rows)
        if alone is not None:
            n, ms = alone
            predicted = coef[0] + coef[1] * n + coef[2] * n * (n + 1) / 2 / 1e3
            print(f"{worker}: a whole {n}-token prompt alone: {predicted:.0f} ms fitted, "
                  f"{statistics.median(ms):.0f} ms measured (median of {len(ms)})")


if __name__ == "__main__":
    main()
