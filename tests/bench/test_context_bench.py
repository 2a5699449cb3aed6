"""`pdserve bench decode-context`: decode steps of short, unique-long and shared-prefix batches
in the engine alone, and the two ratios drawn from them."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.context_bench import ContextRow, ContextSettings, format_table, run_bench
from tests.planner.cli_run import run_pdserve


def test_the_ratios_are_the_slopes_over_the_short_baseline():
    """B = 4, 1,000 extra context tokens each: unique 8 ms over short is 2 us a token; shared
    2 ms over short is a quarter of unique's extra (the prefix paid once of four)."""
    row = ContextRow(batch=4, short_ms=10.0, unique_ms=18.0, shared_ms=12.0,
                     context_tokens=1352, own_tokens=352)
    assert row.per_context_token_us == pytest.approx(2.0)
    assert row.shared_over_unique == pytest.approx(0.25)
    assert "2.000" in format_table([row]) and "0.25" in format_table([row])


def test_a_run_on_a_tiny_model_times_every_batch(tiny_model):
    s = ContextSettings(model=str(tiny_model()), batches=(2, 3), context=96, own=32, steps=3,
                        repeats=1, dtype="float32", threads=1)
    before = torch.get_num_threads()
    try:
        rows = run_bench(s)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert [r.batch for r in rows] == [2, 3]
    assert all(r.short_ms > 0 and r.unique_ms > 0 and r.shared_ms > 0 for r in rows)
    assert all(r.context_tokens == 96 and r.own_tokens == 32 for r in rows)


@pytest.mark.parametrize(("kw", "message"), [
    ({"batches": (1,)}, "batches must be integers >= 2"),
    ({"own": 2000}, "own .2000. must be positive and under context"),
    ({"steps": 0}, "steps must be positive"),
    ({"threads": 0}, "threads must be positive"),
])
def test_bad_settings_say_what_to_fix(kw, message):
    with pytest.raises(ValueError, match=message):
        ContextSettings(**kw)


def test_a_context_past_the_models_positions_is_refused(tiny_model, capsys):
    rc, _, err = run_pdserve(["bench", "decode-context", "--model", str(tiny_model()),
                              "--context", "100000", "--dtype", "float32"], capsys)
    assert rc == 2 and "exceed" in err and "positions" in err
