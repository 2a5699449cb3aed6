"""Whether one run tells two configurations' goodputs apart: `bench compare` sends every
configuration the same trace, so each request met the SLO under both, under neither, or under
one only, and only the last count.

With b requests that met it under configuration A only and c under B only, the exact two-sided
McNemar test (a binomial sign test on the b + c discordant requests, each as likely either way
when A and B are alike; McNemar, Psychometrika 12, 1947):

    p = min(1, 2 x sum over i = 0 .. min(b, c) of C(b + c, i) / 2^(b + c))

A small p: A and B differ beyond what chance puts between two runs of one configuration; a
large one: the run does not say which is better (8 against 2 gives 0.11, 2 against 0 gives
0.5). Meeting the SLO is `bench serve`'s goodput rule (serve/metrics.py `within_slo`) on the
results' per-request records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdserve.bench.serve.metrics import Slo, within_slo


@dataclass(frozen=True)
class Paired:
    """Requests that met the SLO under `a` only and under `b` only, and the test's p."""

    a: str
    b: str
    only_a: int
    only_b: int
    p: float


def mcnemar_p(only_a: int, only_b: int) -> float:
    """The exact two-sided p above (1 with no discordant request)."""
    n = only_a + only_b
    tail = sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1))
    return min(1.0, 2 * tail / 2**n)


def met_slo(result: dict[str, Any]) -> list[bool]:
    """Per request of one configuration's results, in trace order: ok and within every SLO
    the run gave (`within_slo`, the rule of the run's goodput)."""
    slo = Slo(result.get("slo_ttft_ms"), result.get("slo_tpot_ms"), result.get("slo_e2e_ms"))
    return [bool(r.get("ok")) and within_slo(r.get("ttft_s"), r.get("tpot_s"), r.get("e2e_s"), slo)
            for r in result.get("requests") or []]


def paired(results: dict[str, Any], a: str, b: str) -> Paired | None:
    """`a` against `b` in one `bench compare` results file; None where either lacks its
    per-request records or they are not the same trace (different counts)."""
    met_a, met_b = met_slo(results.get(a) or {}), met_slo(results.get(b) or {})
    if not met_a or len(met_a) != len(met_b):
        return None
    only_a = sum(x and not y for x, y in zip(met_a, met_b, strict=True))
    only_b = sum(y and not x for x, y in zip(met_a, met_b, strict=True))
    return Paired(a, b, only_a, only_b, mcnemar_p(only_a, only_b))
