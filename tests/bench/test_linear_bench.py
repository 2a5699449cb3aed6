"""`pdserve bench linear`: its settings refuse nonsense, and a run prints one row per row count
and linear of the layer, both sides timed on the same shape."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.linear_bench import LinearSettings
from pdserve.cli import main
from pdserve.engine import kernels
from pdserve.engine.model.packed_linear import linear_kernel


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rows": ()}, "row counts must be positive"),
    ({"rows": (8, 0)}, "row counts must be positive"),
    ({"intermediate": 0}, "intermediate must be positive, got 0"),
    ({"rounds": -1}, "rounds must be positive, got -1"),
])
def test_bad_settings_say_what_to_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LinearSettings(**kwargs)


def test_the_layer_has_its_four_linears_in_model_shapes():
    assert LinearSettings().layers() == [("qkv", 576, 960), ("o", 576, 576),
                                         ("gate_up", 576, 3072), ("down", 1536, 576)]


def test_a_run_prints_a_row_per_row_count_and_linear(capsys):
    if linear_kernel(kernels.cpu_ops()) is None:
        pytest.skip("this CPU runs none of pdserve's linear kernels")
    assert main(["bench", "linear", "--rows", "1,40", "--shape", "64,96,2,1,32",
                 "--repeats", "1", "--rounds", "2", "--json"]) == 0
    out = capsys.readouterr()
    assert "vs oneDNN (prepacked)" in out.err
    rows = [json.loads(line) for line in out.out.splitlines()]
    assert [(r["rows"], r["name"], r["in_features"], r["out_features"]) for r in rows] == [
        (t, name, n_in, n_out) for t in (1, 40)
        for name, n_in, n_out in (("qkv", 64, 128), ("o", 64, 64), ("gate_up", 64, 192),
                                  ("down", 96, 64))]
    assert all(r["pdserve_ms"] > 0 and r["onednn_ms"] > 0 and r["speedup"] > 0 for r in rows)


def test_a_shape_of_the_wrong_length_is_refused(capsys):
    assert main(["bench", "linear", "--shape", "576,1536"]) != 0
    assert "--shape takes five integers" in capsys.readouterr().err
