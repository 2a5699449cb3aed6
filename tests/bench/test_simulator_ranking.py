"""`pdserve bench simulator`'s ranking: whether the layout the simulation ranks best by goodput
is the one measured best, a tie within 5%, or one the measurement cannot tell apart from it
(paired requests over every round, or rounds that do not hold the order)."""

from __future__ import annotations

import pytest

from pdserve.bench.simulator_check import format_check
from pdserve.bench.simulator_ranking import rank_line, rankings

SLO = {"slo_ttft_ms": 2000.0, "slo_tpot_ms": 100.0}


def _row(config: str, measured: float, simulated: float) -> dict:
    return {"workload": "long", "config": config, "measured": {"request_goodput": measured},
            "simulated": {"request_goodput": simulated}}


def _requests(met: str) -> list[dict]:
    """One request per character, in trace order: "1" met the SLO, "0" missed its TTFT."""
    return [{"ok": True, "ttft_s": 1.0 if m == "1" else 3.0, "tpot_s": 0.05, "e2e_s": 5.0}
            for m in met]


def _results(*rounds: str) -> dict:
    """A configuration's bench compare results: each round's requests under `repeats`, the
    last round's at the top."""
    repeats = [{"requests": _requests(m)} for m in rounds]
    return {**SLO, "requests": _requests(rounds[-1]),
            **({"repeats": repeats} if len(rounds) > 1 else {})}


@pytest.mark.parametrize(("measured", "agree", "says"), [
    ((0.283, 0.282), True, "agree (a tie: the simulated best measured 0.4% below"),
    ((0.300, 0.250), False, "DISAGREE (the simulated best measured 16.7% below"),
])
def test_without_pairs_or_rounds_the_pick_agrees_within_five_percent_of_the_best(
        measured, agree, says):
    rows = [_row("collocated-chunked", measured[0], 0.20), _row("collocated", measured[1], 0.27)]
    rank = rankings(rows, {})["long"]
    assert (rank["measured"], rank["simulated"]) == ("collocated-chunked", "collocated")
    assert rank["agree"] is agree
    assert says in format_check({"calibrated_on": "mixed", "rows": [], "ranking": {"long": rank}})


def test_the_same_best_on_both_sides_agrees_with_no_regret():
    rank = rankings([_row("disagg", 0.5, 0.6), _row("collocated", 0.4, 0.3)], {})["long"]
    assert rank == {"measured": "disagg", "simulated": "disagg", "regret": 0.0, "agree": True,
                    "why": "same", "top": 0.5, "paired": []}


def test_a_workload_whose_requests_all_missed_the_slo_is_not_called_an_agreement():
    """Long prompts past the TTFT bound everywhere: goodput 0 on both sides, whichever
    configuration max() happens to pick is no ranking."""
    rank = rankings([_row("collocated", 0.0, 0.0), _row("disagg", 0.0, 0.0)], {})["long"]
    assert rank["top"] == 0 and rank["agree"] is True  # not a disagreement either
    assert "paired" not in rank
    text = format_check({"calibrated_on": "diurnal", "rows": [], "ranking": {"long": rank}})
    assert "long: nothing to rank: no configuration's requests met the SLO" in text
    assert "agree" not in text.splitlines()[-1]


def test_a_pick_a_few_requests_below_the_best_is_unresolved_not_a_disagreement():
    """Measured over two rounds of 12 requests: chunked met the SLO for 11 and 10, collocated
    for 9 and 10 (3 requests under chunked only, 1 under collocated only: p = 0.62); the
    simulation picked collocated, 9.5% below."""
    results = {"collocated-chunked": _results("111111111110", "111111111100"),
               "collocated": _results("111111111000", "111111110110")}
    rows = [_row("collocated-chunked", 0.21, 0.25), _row("collocated", 0.19, 0.27)]
    rank = rankings(rows, {"long": results})["long"]
    assert (rank["agree"], rank["why"]) == (True, "paired")
    assert rank["paired"] == [{"a": "collocated-chunked", "b": "collocated", "only_a": 3,
                               "only_b": 1, "p": 0.625, "rounds": 2}]
    assert rank_line("long", rank) == (
        "long: best by goodput measured collocated-chunked, simulated collocated: agree "
        "(unresolved: the simulated best measured 9.5% below the measured best, which the "
        "paired requests do not tell apart, p >= 0.05); requests that met the SLO under the "
        "measured best only / the other only over 2 rounds, exact McNemar p: collocated 3/1 "
        "(p = 0.62)")


def test_a_pick_the_paired_requests_hold_worse_disagrees():
    """disagg met the SLO for none of the 12 requests of either round, collocated for 10 and
    11: 21 discordant requests all one way (p ~ 1e-6), however close the simulation put them."""
    results = {"collocated": _results("111111111100", "111111111110"),
               "disagg": _results("000000000000", "000000000000")}
    rows = [_row("collocated", 0.35, 0.30), _row("disagg", 0.0, 0.31)]
    rank = rankings(rows, {"long": results})["long"]
    assert (rank["agree"], rank["why"]) == (False, "paired")
    assert rank["paired"][0]["p"] == pytest.approx(2 / 2**21)
    assert "DISAGREE (the simulated best measured 100.0% below" in rank_line("long", rank)


def test_without_pairs_rounds_decide_whether_the_measurement_holds_the_order():
    """A closed loop (chat): requests do not pair (each server sent as many as its speed let
    it). The pick 8% below the best by the rounds' medians agrees where one round put it within
    5% of the best, and disagrees where every round put it further below."""
    def chat(best: tuple[float, float], pick: tuple[float, float]) -> dict:
        return {"collocated": {"repeats": [{"request_goodput": g} for g in best]},
                "collocated-chunked": {"repeats": [{"request_goodput": g} for g in pick]}}

    rows = [_row("collocated", 3.6, 3.7), _row("collocated-chunked", 3.3, 3.8)]
    held = rankings(rows, {"long": chat((3.5, 3.7), (3.0, 3.6))})["long"]
    assert (held["agree"], held["why"]) == (True, "rounds")
    assert "agree (unresolved: the simulated best measured 8.3% below the measured best, and " \
           "within 5% of it or above in a round)" in rank_line("long", held)
    told = rankings(rows, {"long": chat((3.5, 3.7), (3.2, 3.4))})["long"]
    assert (told["agree"], told["why"]) == (False, "rounds")
