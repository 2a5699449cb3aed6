"""Round-by-round ratios of `bench compare --repeats N`: each configuration's run against the
first configuration's run of the same round.

Each round runs every configuration once, back to back, so two runs of one round met the
machine in about the same state. On a shared VM whose speed moves by 2x within minutes, the
ratio of two medians taken over the rounds separately mixes states: one fast round of one
configuration beside a slow round of the other moves it. The median over the rounds of each
round's ratio,

    paired(key) = median_i (run_i[config][key] / run_i[first][key]),

compares only runs that met the machine together, and the per-round ratios show its spread.
A round whose two values are not both finite numbers, or whose first value is 0, gives no
ratio for that key.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.common.numbers import is_finite_number

# What the round-by-round lines show: latency at the median and the tail, the SLO's figure
# and throughput.
PAIRED_KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "request_goodput",
               "output_throughput")


def round_ratios(runs: Sequence[Mapping[str, Any]], first: Sequence[Mapping[str, Any]],
                 key: str) -> list[float]:
    """Each round's run[key] / first[key], in round order, where both are finite numbers and
    the first is not 0. Raises ValueError when the two lists of rounds differ in length."""
    if len(runs) != len(first):
        raise ValueError(f"{len(runs)} rounds against {len(first)}: not paired")
    out = []
    for run, base in zip(runs, first, strict=True):
        v, b = run.get(key), base.get(key)
        if is_finite_number(v) and is_finite_number(b) and b != 0:
            out.append(v / b)
    return out


def paired_lines(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """For results combined from several rounds (each with `repeats`), a line per other
    configuration and PAIRED_KEYS key: the median of the rounds' ratios and each round's;
    nothing for results of one round."""
    names = list(results)
    rounds = {n: results[n].get("repeats") for n in names}
    if len(names) < 2 or any(not r or len(r) < 2 for r in rounds.values()):
        return []
    first = names[0]
    lines = [f"round by round (each run over {first}'s run of the same round; the median of "
             "the rounds' ratios, then each round's):"]
    for name in names[1:]:
        for key in PAIRED_KEYS:
            ratios = round_ratios(rounds[name], rounds[first], key)
            if ratios:
                each = ", ".join(f"{r:.2f}" for r in ratios)
                lines.append(f"  {name} {key}: {statistics.median(ratios):.2f}x ({each})")
    return lines
