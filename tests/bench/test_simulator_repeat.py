"""`pdserve bench simulator-repeat`: a held-out miss is noise when the measured figure itself
moved by more than the tolerance between two runs, the model's when both runs miss it on the
same side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench.simulator_check import FIGURES
from pdserve.bench.simulator_repeat import compare, format_repeat, load
from pdserve.cli import main


def _summary(folder: Path, ttft: tuple[float, float], itl: tuple[float, float]) -> Path:
    """A summary with one row: median TTFT and median ITL (measured, simulated); every other
    figure measured 1, simulated 1."""
    measured = dict.fromkeys(FIGURES, 1.0) | {"median_ttft_ms": ttft[0], "median_itl_ms": itl[0]}
    simulated = dict.fromkeys(FIGURES, 1.0) | {"median_ttft_ms": ttft[1],
                                               "median_itl_ms": itl[1]}
    row = {"workload": "long", "config": "disagg", "measured": measured, "simulated": simulated,
           "rel_error": {f: simulated[f] / measured[f] - 1 for f in FIGURES},
           "tolerance": dict.fromkeys(FIGURES, 0.25) | {"p99_itl_ms": 0.35}}
    folder.mkdir()
    (folder / "simulator_check.json").write_text(json.dumps({"rows": [row]}))
    return folder


def _verdicts(tmp_path: Path, a: tuple, b: tuple) -> dict[str, str]:
    entries = compare(load(_summary(tmp_path / "a", *a)), load(_summary(tmp_path / "b", *b)))
    assert len(entries) == len(FIGURES)
    return {e["figure"]: e["verdict"] for e in entries}


def test_a_figure_that_moved_more_than_its_tolerance_is_noise(tmp_path) -> None:
    # TTFT measured 1,000 then 1,400 ms (+40%); ITL 20 then 21 ms, simulated 30 both times
    got = _verdicts(tmp_path, ((1000, 1500), (20, 30)), ((1400, 1500), (21, 30)))
    assert got["median_ttft_ms"] == "noise"
    assert got["median_itl_ms"] == "model"  # +50% and +43%: over, both runs
    assert {got[f] for f in FIGURES if f not in ("median_ttft_ms", "median_itl_ms")} == {
        "within"}


def test_a_miss_in_one_run_only_or_on_both_sides_is_not_the_models(tmp_path) -> None:
    # TTFT: simulated +30% in A, +10% in B; ITL: -30% in A, +30% in B (measured within 10%)
    got = _verdicts(tmp_path, ((1000, 1300), (20, 14)), ((1000, 1100), (22, 28.6)))
    assert got["median_ttft_ms"] == "one run"
    assert got["median_itl_ms"] == "one run"


def test_the_table_names_each_verdict_and_counts_them(tmp_path, capsys) -> None:
    a = _summary(tmp_path / "a", (1000, 1500), (20, 30))
    b = _summary(tmp_path / "b", (1400, 1500), (21, 30))
    text = format_repeat(compare(load(a), load(b)))
    assert "long  disagg  median_ttft_ms  1e+03 -> 1.4e+03 (+40%)  +50%, +7%  noise" in text
    assert text.splitlines()[-1] == "6 figures: 1 noise, 1 model, 0 one run, 4 within"
    assert main(["bench", "simulator-repeat", str(a), str(b), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["verdict"] for r in rows if r["figure"] == "median_ttft_ms"] == ["noise"]


def test_a_folder_without_a_summary_says_how_to_make_one(tmp_path) -> None:
    with pytest.raises(ValueError, match="run `pdserve bench simulator --out"):
        load(tmp_path)
