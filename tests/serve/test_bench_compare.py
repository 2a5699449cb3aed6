"""`pdserve bench compare`: each configuration started on the same cores, one table, JSON keyed
by configuration, pictures; and its settings refuse what cannot run."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import pytest

from pdserve.bench.compare import add_compare_args, format_table, settings
from pdserve.cli import main
from pdserve.cluster.up_process import free_port


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_compare_args(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(("argv", "message"), [
    (("--configs", "collocated,warp-drive"), "unknown configurations"),
    (("--configs", "disagg", "--external", "disagg=http://x/v1"), "unique"),
    (("--external", "no-equals-sign"), "NAME=URL"),
    (("--cores", "99"), "--cores"),
    (("--external-start", "vllm=serve.sh"), "no --external"),
])
def test_settings_refuse_what_cannot_run(argv, message) -> None:
    with pytest.raises(ValueError, match=message):
        settings(_args(*argv))


def test_table_gives_ratios_to_the_first_configuration() -> None:
    table = format_table({"a": {"completed": 10, "p99_itl_ms": 200.0},
                          "b": {"completed": 10, "p99_itl_ms": 50.0}})
    row = next(line for line in table.splitlines() if line.startswith("p99_itl_ms"))
    assert "200.00" in row and "50.00 (0.25x)" in row


def test_compare_runs_each_configuration_and_writes_json_and_pictures(tiny_model,
                                                                      tmp_path: Path) -> None:
    out, plots = tmp_path / "cmp.json", tmp_path / "plots"
    port = free_port()
    worker = (f"{sys.executable} -m pdserve.cli worker --model {tiny_model()} --dtype float32 "
              f"--port {port} --serve-public")
    code = main(["bench", "compare", "--model", str(tiny_model()), "--configs",
                 "collocated,disagg", "--workload", "fixed", "--input-len", "300",
                 "--output-len", "8", "--vocab", "512", "--rate", "8", "--num-requests", "6",
                 "--external", f"worker-alone=http://127.0.0.1:{port}/v1",
                 "--external-start", f"worker-alone={worker}",
                 "--out", str(out), "--plots", str(plots)])
    assert code == 0
    results = json.loads(out.read_text())
    assert list(results) == ["collocated", "disagg", "worker-alone"]
    with socket.socket() as s:  # the external server was stopped after its turn
        assert s.connect_ex(("127.0.0.1", port)) != 0
    for r in results.values():
        assert r["completed"] == 6 and r["failed"] == 0 and "p99_itl_ms" in r
        warm = r["warm_up"]  # served before the run, kept for the simulator to serve first
        assert [w["prompt_tokens"] for w in warm] == [300, 300]
        assert all(1 <= w["output_tokens"] <= 4 for w in warm)
    routes = {name: {q["route"] for q in r["requests"]} for name, r in results.items()}
    assert routes["collocated"] == {"local; rule=collocated_worker"}
    assert routes["disagg"] <= {f"{path}; rule={rule}" for path in ("local", "disaggregated")
                                for rule in ("unmeasured", "measured_cost", "tpot_target")}
    assert routes["worker-alone"] == {None}  # a worker alone routes nothing
    cores = len(os.sched_getaffinity(0))
    for name, workers in (("collocated", 1), ("disagg", 2)):  # pdserve's: probed idle after
        probe = results[name]["frontend_probe"]
        assert probe["prompt_tokens"] == 32 and len(probe["ttft_s"]) == 5
        assert all(t > 0 for t in probe["ttft_s"])
        assert len(probe["step_s"]) == 5  # each probe's own prompt step, inside its TTFT
        assert all(0 < s < t for s, t in zip(probe["step_s"], probe["ttft_s"], strict=True))
        ref = results[name]["speed_reference"]  # timed alone before and after the run
        assert ref["threads"] == max(1, cores // workers) and ref["prefill_tokens"] == 512
        assert len(ref["prefill_s"]) == 2 and all(t > 0 for t in ref["prefill_s"])
        assert (ref["decode_streams"], ref["decode_prompt_tokens"]) == (8, 128)
        assert len(ref["decode_step_s"]) == 2 and all(t > 0 for t in ref["decode_step_s"])
    assert "speed_reference" not in results["worker-alone"]
    steps = json.loads(out.with_suffix(".steps.json").read_text())
    assert set(steps["disagg"]) == {"prefill-0", "decode-0"}
    assert any(s[2] == 300 for s in steps["disagg"]["prefill-0"])  # prompts split off
    assert all(s[2] != 32 for w in steps.values() for rows in w.values() for s in rows)
    assert sorted(p.name for p in plots.iterdir()) == ["itl_cdf.png", "timeline.png",
                                                       "ttft_cdf.png"]


def test_compare_repeats_give_medians_and_keep_every_run(tiny_model, tmp_path: Path,
                                                         capsys) -> None:
    """--repeats 2 on a short run: a pdserve configuration and a started external server are
    each run twice; the table and JSON give medians, the JSON also both runs."""
    out, port = tmp_path / "rep.json", free_port()
    worker = (f"{sys.executable} -m pdserve.cli worker --model {tiny_model()} --dtype float32 "
              f"--port {port} --serve-public")
    code = main(["bench", "compare", "--model", str(tiny_model()), "--configs", "collocated",
                 "--workload", "fixed", "--input-len", "300", "--output-len", "8", "--vocab",
                 "512", "--rate", "8", "--num-requests", "4", "--repeats", "2",
                 "--external", f"worker-alone=http://127.0.0.1:{port}/v1",
                 "--external-start", f"worker-alone={worker}", "--out", str(out),
                 "--no-speed-reference"])
    assert code == 0
    assert "each value is the median of 2 runs" in capsys.readouterr().out
    results = json.loads(out.read_text())
    assert list(results) == ["collocated", "worker-alone"]
    for r in results.values():
        runs = r["repeats"]
        assert [run["completed"] for run in runs] == [4, 4] and r["completed"] == 4
        for key in ("p99_itl_ms", "mean_ttft_ms", "request_throughput"):
            assert r[key] == pytest.approx((runs[0][key] + runs[1][key]) / 2)
        assert len(r["requests"]) == 4  # the last run's
        assert "speed_reference" not in r
    steps = json.loads(out.with_suffix(".steps.json").read_text())
    assert set(steps) == {"collocated"} and results["collocated"]["steps_rounds"] == 2
    rows = steps["collocated"]["collocated-0"]  # both rounds' steps: 2 x 4 prompts of 300
    assert sum(row[2] for row in rows) == 2 * 4 * 300
    assert [row[0] for row in rows] == sorted(row[0] for row in rows)
