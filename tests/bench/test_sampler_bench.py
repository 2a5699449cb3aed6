"""`pdserve bench sampler`: its settings are checked, and a run on a small vocabulary times every
way of drawing and says how the race compares with the inverse CDF."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.sampler_bench import WAYS, SamplerSettings, format_table, measure
from pdserve.cli import main


@pytest.mark.parametrize("bad", [{"batches": ()}, {"batches": (0,)}, {"vocab": 0},
                                 {"repeats": 0}, {"rounds": -1}, {"scale": 0.0}])
def test_bad_settings_raise_value_error(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplerSettings(**bad)


def test_a_small_run_times_every_way() -> None:
    row = measure(4, SamplerSettings(batches=(4,), vocab=512, repeats=2, rounds=2))
    assert row.batch == 4 and set(row.ms) == set(WAYS)
    assert all(ms > 0 for ms in row.ms.values())
    assert row.race_over_inverse > 0 and row.ops_over_compiled > 0
    assert row.top_p_ops_over_compiled > 0
    table = format_table([row])
    assert "race / inverse" in table.splitlines()[0]
    assert "ops / compiled" in table.splitlines()[0]
    assert "top-p ops / compiled" in table.splitlines()[0]
    assert table.splitlines()[2].split()[0] == "4"


def test_the_command_prints_a_json_row_per_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sampler", "--batches", "1,3", "--vocab", "256", "--repeats", "1",
                 "--rounds", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(set(r["ms"]) == set(WAYS) for r in rows)
    assert main(["bench", "sampler", "--batches", "1,x"]) != 0
    assert "--batches takes comma-separated integers" in capsys.readouterr().err
