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
results' per-request records. With `bench compare --repeats N` every round replays the same
trace and keeps its requests' outcomes (compare.py), and the counts b and c are summed over the
rounds: the test then weighs every request of every round, where one round alone has ~30 long
prompts to tell two layouts apart by.
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
    rounds: int = 1  # rounds whose requests were paired (summed into only_a and only_b)


def mcnemar_p(only_a: int, only_b: int) -> float:
    """The exact two-sided p above (1 with no discordant request)."""
    n = only_a + only_b
    tail = sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1))
    return min(1.0, 2 * tail / 2**n)


def met_slo(result: dict[str, Any]) -> list[bool]:
    """Per request of one configuration's results, in trace order: ok and within every SLO
    the run gave (`within_slo`, the rule of the run's goodput)."""
    return _met(result.get("requests") or [], _slo(result))


def _slo(result: dict[str, Any]) -> Slo:
    return Slo(result.get("slo_ttft_ms"), result.get("slo_tpot_ms"), result.get("slo_e2e_ms"))


def _met(requests: list[dict[str, Any]], slo: Slo) -> list[bool]:
    return [bool(r.get("ok")) and within_slo(r.get("ttft_s"), r.get("tpot_s"), r.get("e2e_s"), slo)
            for r in requests]


def paired(results: dict[str, Any], a: str, b: str) -> Paired | None:
    """`a` against `b` in one `bench compare` results file, over every round whose requests
    both kept (the last round's `requests` where a round lacks them); None where either lacks
    its per-request records or they are not the same trace (different counts)."""
    ra, rb = results.get(a) or {}, results.get(b) or {}
    slo_a, slo_b = _slo(ra), _slo(rb)
    counts = [_count(_met(x, slo_a), _met(y, slo_b)) for x, y in _rounds(ra, rb)]
    if not counts or None in counts:
        return None
    only_a = sum(c[0] for c in counts)
    only_b = sum(c[1] for c in counts)
    return Paired(a, b, only_a, only_b, mcnemar_p(only_a, only_b), len(counts))


def _rounds(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[list[Any], list[Any]]]:
    """(a's requests, b's requests) per round: every round where both sides' rounds all kept
    requests and are as many, else the last round's alone."""
    ra, rb = a.get("repeats") or [], b.get("repeats") or []
    if ra and len(ra) == len(rb) and all(r.get("requests") for r in (*ra, *rb)):
        return [(x["requests"], y["requests"]) for x, y in zip(ra, rb, strict=True)]
    return [(a.get("requests") or [], b.get("requests") or [])]


def _count(met_a: list[bool], met_b: list[bool]) -> tuple[int, int] | None:
    """(requests that met the SLO under a only, under b only), or None (not the same trace)."""
    if not met_a or len(met_a) != len(met_b):
        return None
    return (sum(x and not y for x, y in zip(met_a, met_b, strict=True)),
            sum(y and not x for x, y in zip(met_a, met_b, strict=True)))
