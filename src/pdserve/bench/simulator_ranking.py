"""Whether `pdserve bench simulator`'s best layout by goodput is the one measured best.

Per held-out workload, the configuration best by goodput is taken on each side, measured and
simulated, and the simulated pick agrees with the measurement when

1. it is the measured best ("same"); or
2. it measured within MARGIN (5%, `pdserve plan`'s tie) of the measured best's goodput
   ("tie"): following the simulator costs less than one run's noise; or
3. the measurement cannot tell the two apart ("unresolved"). Where the requests pair (an
   open-loop trace: `bench compare` replays the same one to every configuration), that is the
   exact McNemar test on the requests that met the SLO under one of the two only, summed over
   the rounds (paired_goodput.py), at p >= ALPHA. Where they do not (a closed loop sends what
   each server's speed lets it) but the run has rounds, it is a round that measured the pick
   within MARGIN of the best, or above it.

Otherwise it DISAGREES: the measurement holds the pick worse than the best. A run with no
configuration within the SLO (`top` 0) leaves nothing to rank, and is no disagreement.

Why the third: two layouts a request or two apart (long prompts: ~25 of ~30 requests within
the SLO per run, collocated and collocated-chunked 1-2 apart, McNemar p 0.22-0.62) swapped
places between runs of the same code minutes apart. A ranking the measurement cannot hold from
one run to the next is not one a simulation can be held to; a ranking it can hold still is:
disagg's 0 against collocated's 25 requests of the same trace has p ~ 1e-8, and a pick of
disagg there disagrees.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pdserve.bench import measured_spread
from pdserve.bench.paired_goodput import paired
from pdserve.planner.plan_simulation import MARGIN

ALPHA = 0.05  # a paired difference with p below this is one the run tells apart


def rankings(rows: list[dict[str, Any]],
             results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per workload of `rows` (bench simulator's rows): {"measured", "simulated": the best of
    each side, "regret": the measured goodput lost by taking the simulated best instead (0: the
    same one), "top": the measured best's goodput, "paired": the measured best against every
    other configuration request by request (where the requests pair), "agree", "why": which
    rule of the module's docstring decided}; `results` each workload's bench compare results."""
    out = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        rank = _best([r for r in rows if r["workload"] == workload])
        measured = results.get(workload, {})
        if rank["top"] > 0:
            pairs = (paired(measured, rank["measured"], c) for c in measured
                     if c != rank["measured"])
            rank["paired"] = [dataclasses.asdict(p) for p in pairs if p is not None]
        rank["agree"], rank["why"] = _verdict(rank, measured)
        out[workload] = rank
    return out


def _best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    goodput = {side: {r["config"]: r[side]["request_goodput"] or 0.0 for r in rows}
               for side in ("measured", "simulated")}
    best = {side: max(g, key=g.__getitem__) for side, g in goodput.items()}
    top = goodput["measured"][best["measured"]]
    picked = goodput["measured"][best["simulated"]]
    return {**best, "regret": (top - picked) / top if top > 0 else 0.0, "top": top}


def _verdict(rank: dict[str, Any], results: dict[str, Any]) -> tuple[bool, str]:
    if rank["top"] == 0:
        return True, "nothing"
    if rank["measured"] == rank["simulated"]:
        return True, "same"
    if rank["regret"] <= MARGIN:
        return True, "tie"
    pair = next((p for p in rank.get("paired", ()) if p["b"] == rank["simulated"]), None)
    if pair is not None:
        return pair["p"] >= ALPHA, "paired"
    best = measured_spread.rounds(results.get(rank["measured"]) or {}, "request_goodput")
    pick = measured_spread.rounds(results.get(rank["simulated"]) or {}, "request_goodput")
    if best and len(best) == len(pick):
        return any(p >= (1 - MARGIN) * b for b, p in zip(best, pick, strict=True)), "rounds"
    return False, "margin"


def rank_line(workload: str, rank: dict[str, Any]) -> str:
    """The check's line for one workload's ranking."""
    if rank["top"] == 0:
        return (f"{workload}: nothing to rank: no configuration's requests met the SLO in the "
                f"measured runs (goodput 0)")
    line = (f"{workload}: best by goodput measured {rank['measured']}, simulated "
            f"{rank['simulated']}: ")
    return line + _verdict_text(rank) + _pair_text(rank.get("paired"))


def _verdict_text(rank: dict[str, Any]) -> str:
    why = rank.get("why")
    if rank["measured"] == rank["simulated"]:
        return "agree"
    lost = f"the simulated best measured {rank['regret']:.1%} below the measured best"
    if not rank["agree"]:
        return f"DISAGREE ({lost})"
    if why == "paired":
        return f"agree (unresolved: {lost}, which the paired requests do not tell apart, " \
               f"p >= {ALPHA:g})"
    if why == "rounds":
        return f"agree (unresolved: {lost}, and within {MARGIN:.0%} of it or above in a round)"
    return f"agree (a tie: {lost}, within {MARGIN:.0%})"


def _pair_text(pairs: list[dict[str, Any]] | None) -> str:
    """"; met the SLO under the measured best only / the other only[, over N rounds]: X b/c
    (exact McNemar p = ...), ..." (paired_goodput.py), or nothing without pairs."""
    if not pairs:
        return ""
    rounds = pairs[0].get("rounds", 1)
    over = f" over {rounds} rounds" if rounds > 1 else ""
    each = [f"{p['b']} {p['only_a']}/{p['only_b']} (p = {p['p']:.2g})" for p in pairs]
    return (f"; requests that met the SLO under the measured best only / the other only{over}, "
            f"exact McNemar p: {', '.join(each)}")
