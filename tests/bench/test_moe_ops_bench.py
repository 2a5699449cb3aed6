"""`pdserve bench moe-ops`: settings refuse what cannot run, a run prints one row per operator
and case with both sides timed, and two sides that disagree stop the run."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.bench.moe_ops_bench import MoeOpsSettings, check_same
from pdserve.cli import main
from pdserve.engine import kernels


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"hidden": 100}, "hidden must be a positive multiple of 64, got 100"),
    ({"batches": (0,)}, "batches must be positive"),
    ({"contexts": ()}, "contexts must be positive"),
    ({"experts": 12}, "experts must be a multiple of 8, at least 16"),
    ({"repeats": 0}, "repeats must be positive"),
])
def test_bad_settings_say_what_to_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoeOpsSettings(**kwargs)


def test_a_run_times_each_operator_beside_its_pytorch_path(capsys):
    if kernels.cpu_ops() is None:
        pytest.skip("no C++ compiler here: no compiled operators to measure")
    assert main(["bench", "moe-ops", "--hidden", "128", "--heads", "2", "--kv-lora-rank", "64",
                 "--batches", "1,3", "--contexts", "5,40", "--experts", "16",
                 "--qwen3-experts", "16", "--repeats", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["op"], r["case"]) for r in rows] == [
        ("mla_decode", "B1 L5"), ("mla_decode", "B1 L40"), ("mla_decode", "B3 L5"),
        ("mla_decode", "B3 L40"), ("router", "B1 E16"), ("router", "B3 E16"),
        ("qwen3_router", "B1 E16"), ("qwen3_router", "B3 E16")]
    for r in rows:
        assert r["pytorch_us"] > 0 and r["operators_us"] > 0
        # printed to 3 decimals: within 0.0005 of the ratio, whatever its size (a relative
        # bound failed for a ratio under 0.5, a tiny shape run slower than PyTorch under load)
        assert r["speedup"] == pytest.approx(r["pytorch_us"] / r["operators_us"], abs=5e-4)


def test_sides_that_disagree_stop_the_run():
    a = torch.ones(4)
    check_same("op", a, a + 1e-3, 2e-2)
    with pytest.raises(RuntimeError, match=r"op: the operators and PyTorch disagree by 0\.5"):
        check_same("op", a, a + 0.5, 2e-2)
