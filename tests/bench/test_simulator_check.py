"""`pdserve bench simulator`: held-out validation of the simulator from results already in its
folder (measuring runs `bench compare`, covered by its own tests): one row per held-out
workload and configuration, the figures' errors against their tolerances, the goodput
ranking, and the exit status."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import simulator_context
from pdserve.bench.simulator_check import (
    CheckSettings,
    compare_args,
    format_check,
    run_check,
    workload_args,
)
from tests.planner.cli_run import run_pdserve
from tests.planner.simulate.step_files import (
    C1,
    context_decode_steps,
    disagg_workers,
    prefill_steps,
    request,
    serve_result,
    write_json,
)


def _settings(tmp_path, **kw) -> CheckSettings:
    base = dict(out_dir=tmp_path, calibrate_on="mixed", held_out=("chat",),
                configs=("disagg", "collocated"), duration_s=60.0, model="smollm2",
                remeasure=False, decode_context="fitted")
    return CheckSettings(**{**base, **kw})


@pytest.fixture
def results(tmp_path):
    """A calibration run (its steps) and a held-out run with one request per configuration:
    the disagg one measured at the simulated TTFT, the collocated one far from it."""
    write_json(tmp_path / "mixed.steps.json", {"disagg": disagg_workers(),
                                               "collocated": disagg_workers()})
    write_json(tmp_path / "mixed.json", {})
    write_json(tmp_path / "chat.json", {
        "disagg": serve_result([request(0.0, 1000, 11)], ttft_ms=210.0, itl_ms=22.0),
        "collocated": serve_result([request(0.0, 1000, 11)], ttft_ms=900.0, itl_ms=22.0)})
    return tmp_path


def test_each_held_out_run_is_simulated_from_the_calibration_run_alone(results):
    summary = run_check(_settings(results))
    rows = {r["config"]: r for r in summary["rows"]}
    assert [r["workload"] for r in summary["rows"]] == ["chat", "chat"]
    assert rows["disagg"]["measured"]["median_ttft_ms"] == 210.0
    assert "median_ttft_ms" not in rows["disagg"]["outside"]
    assert rows["collocated"]["rel_error"]["median_ttft_ms"] == pytest.approx(210 / 900 - 1)
    assert "median_ttft_ms" in rows["collocated"]["outside"]
    assert set(summary["ranking"]["chat"]) == {"measured", "simulated", "regret", "agree", "why",
                                               "top"}
    text = format_check(summary)
    assert "fitted on 'mixed'" in text and "900->210 (-77%)*" in text


def test_the_command_exits_1_when_a_figure_is_outside_and_writes_the_summary(results, capsys):
    rc, _, _ = run_pdserve(["bench", "simulator", "--out", str(results), "--calibrate-on",
                            "mixed", "--held-out", "chat", "--configs", "disagg,collocated",
                            "--decode-context", "fitted"], capsys)
    assert rc == 1
    saved = json.loads((results / "simulator_check.json").read_text())
    assert saved["calibrated_on"] == "mixed" and len(saved["rows"]) == 2


def test_a_repeated_runs_figures_whose_rounds_moved_past_their_tolerance_are_marked_noise(
        results):
    """Collocated's TTFT rounds 600 and 1,200 ms (their median 900): noise, marked ~ beside its
    miss and counted; disagg's rounds 205 and 215: not."""
    chat = json.loads((results / "chat.json").read_text())
    chat["collocated"]["repeats"] = [{"median_ttft_ms": 600.0}, {"median_ttft_ms": 1200.0}]
    chat["disagg"]["repeats"] = [{"median_ttft_ms": 205.0}, {"median_ttft_ms": 215.0}]
    write_json(results / "chat.json", chat)
    summary = run_check(_settings(results, repeats=2))
    rows = {r["config"]: r for r in summary["rows"]}
    assert rows["collocated"]["rounds"] == {"median_ttft_ms": [600.0, 1200.0]}
    assert rows["collocated"]["noise"] == ["median_ttft_ms"]
    assert rows["disagg"]["noise"] == []
    text = format_check(summary)
    assert "900->210 (-77%)*~" in text and "~ its measured rounds moved" in text
    out = len(rows["collocated"]["outside"]) + len(rows["disagg"]["outside"])
    compared = sum(e is not None for r in rows.values() for e in r["rel_error"].values())
    assert f"\n{out} of {compared} figures outside their tolerance, 1 of them noise (~);" \
        in text


def test_a_run_of_one_round_has_no_noise_mark(results):
    text = format_check(run_check(_settings(results)))
    count = text.splitlines()[-2]
    assert "~" not in text and "noise" not in count
    assert count.split(";")[0].endswith("figures outside their tolerance")


@pytest.mark.parametrize(("kw", "message"), [
    ({"held_out": ("weekly",)}, "unknown workload 'weekly'"),
    ({"held_out": ("mixed",)}, "'mixed' is the calibration workload"),
    ({"configs": ("collocated-2",)}, "cannot be simulated"),
    ({"slo_itl_ms": 50.0}, "slo_itl_ms must be at least the 100 ms TPOT target, got 50.0"),
    ({"duration_s": 0.0}, "duration must be positive"),
    ({"load": 0.0}, r"load must be in \(0, 100\], got 0.0"),
    ({"repeats": 0}, "repeats must be a whole number >= 1, got 0"),
    ({"repeats": 2.0}, "repeats must be a whole number >= 1, got 2.0"),
    ({"speed_window_s": float("nan")}, "speed window must be > 0 seconds, got nan"),
])
def test_bad_settings_say_what_to_fix(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        _settings(tmp_path, **kw)


def test_repeats_measure_every_workload_in_interleaved_rounds(tmp_path):
    out = tmp_path / "diurnal.json"
    once = compare_args(_settings(tmp_path, duration_s=180.0), "diurnal", out)
    assert "--repeats" not in once
    assert once[:2] == ["bench", "compare"] and once[-2:] == ["--out", str(out)]
    assert once[once.index("--phase-s") + 1] == "60"
    thrice = compare_args(_settings(tmp_path, repeats=3), "chat", out)
    assert thrice[thrice.index("--repeats") + 1] == "3"


def test_an_itl_ceiling_reaches_every_measurement_and_results_measured_without_it_are_refused(
        results):
    args = compare_args(_settings(results, slo_itl_ms=300.0), "chat", results / "chat.json")
    assert args[args.index("--slo-itl-ms") + 1] == "300"
    assert "--slo-itl-ms" not in compare_args(_settings(results), "chat", results / "c.json")
    write_json(results / "mixed.json", {"disagg": {"slo_itl_ms": 500.0},
                                        "collocated": {"slo_itl_ms": None}})  # paces no step
    with pytest.raises(ValueError, match=r"measured with ITL ceilings \{'disagg': 500.0, "
                                         r"'collocated': None\} \(ms\), not 300.0 "
                                         r"\(--slo-itl-ms\): --remeasure"):
        run_check(_settings(results, slo_itl_ms=300.0))
    with pytest.raises(ValueError, match=r"not None \(--slo-itl-ms\)"):
        run_check(_settings(results))
    write_json(results / "mixed.json", {"disagg": {"slo_itl_ms": 300.0},
                                        "collocated": {"slo_itl_ms": None}})
    summary = run_check(_settings(results, slo_itl_ms=300.0))
    assert summary["slo_itl_ms"] == 300.0
    assert ", paced steps up to 300 ms" in format_check(summary)
    assert "paced steps up to" not in format_check({**summary, "slo_itl_ms": None})


def test_load_scales_each_open_loop_rate_and_leaves_the_closed_loop_alone():
    assert workload_args("long", 0.5) == ("--workload", "rag", "--rate", "0.2")
    assert workload_args("mixed", 0.5) == ("--workload", "mixed", "--rate", "0.5")
    assert workload_args("diurnal", 1.0) == ("--workload", "diurnal", "--rate", "0.4")
    assert workload_args("chat", 0.5) == ("--workload", "chat", "--concurrency", "16")


def test_results_measured_at_another_load_are_not_reused(results):
    """mixed.json measured at --rate 1 (load 1) is refused for --load 0.5, naming the rates; at
    load 1 it is reused, and a closed-loop run has no rate to disagree with."""
    write_json(results / "mixed.json", {"disagg": {"request_rate": 1.0},
                                        "collocated": {"request_rate": 1.0}})
    with pytest.raises(ValueError, match=r"request rates \{'disagg': 1.0, 'collocated': 1.0\}, "
                                         r"not 0.5 req/s \(--load 0.5\): --remeasure"):
        run_check(_settings(results, load=0.5))
    assert run_check(_settings(results))["load"] == 1.0
    write_json(results / "mixed.json", {"disagg": {"request_rate": 0.5},
                                        "collocated": {"request_rate": 0.5}})
    chat = json.loads((results / "chat.json").read_text())
    for config in chat.values():
        config["request_rate"] = None  # a closed loop's results say no rate
    write_json(results / "chat.json", chat)
    summary = run_check(_settings(results, load=0.5))
    assert summary["load"] == 0.5 and len(summary["rows"]) == 2
    assert "fitted on 'mixed', open-loop rates x0.5" in format_check(summary)
    chat["disagg"]["request_rate"] = 2.0  # an open-loop run where the closed loop was asked
    write_json(results / "chat.json", chat)
    with pytest.raises(ValueError, match=r"request rates \{'disagg': 2.0\}, not a closed loop"):
        run_check(_settings(results, load=0.5))


def test_a_split_configurations_row_has_its_local_prefills_measured_and_simulated(results):
    chat = json.loads((results / "chat.json").read_text())
    chat["disagg"]["split_decisions"] = {"local": 1, "remote": 0,
                                         "by_reason": {"local/measured_cost": 1}}
    write_json(results / "chat.json", chat)
    summary = run_check(_settings(results))
    rows = {r["config"]: r for r in summary["rows"]}
    simulated = rows["disagg"]["local_prefills"]["simulated"]
    assert rows["disagg"]["local_prefills"]["measured"] == 1
    assert "local_prefills" not in rows["collocated"]
    lines = format_check(summary).splitlines()
    assert lines[1].endswith("local_prefills(measured/simulated)  speed  "
                             "steps(measured/priced: median/time)")
    assert lines[2].startswith("chat  disagg") and lines[2].endswith(f"  1/{simulated}  -  -")
    assert lines[3].startswith("chat  collocated") and lines[3].endswith("  -  -  -")


def _elastic(flips: int) -> dict:
    """bench compare's record of an elastic pair: lent at rest and merged, or flipped too."""
    role = {"prefill-0": "prefill", "decode-0": "decode"}
    return {"workers": {w: {"roles": [{"role": r}], "steps": {"busy_s": 0.0 if r == "prefill"
                                                                else 9.0}}
                        for w, r in role.items()},
            "role_flips": flips, "core_loans": 1}


@pytest.mark.parametrize(("calibration_flips", "held_out_flips", "changed"), [
    (0, 0, None), (1, 0, "calibration"), (0, 2, "held-out")])
def test_an_elastic_run_is_simulated_as_its_merged_pair_or_listed_as_not_simulated(
        results, calibration_flips, held_out_flips, changed):
    """Merged in both runs: every prompt prefilled on the decode worker (split local); a pair
    whose layout changed in either run is not simulated, says why, and fails the check."""
    steps = json.loads((results / "mixed.steps.json").read_text())
    write_json(results / "mixed.steps.json", {**steps, "elastic": disagg_workers()})
    write_json(results / "mixed.json", {"elastic": _elastic(calibration_flips)})
    chat = json.loads((results / "chat.json").read_text())
    chat["elastic"] = serve_result([request(0.0, 1000, 11)]) | _elastic(held_out_flips)
    write_json(results / "chat.json", chat)
    summary = run_check(_settings(results, configs=("collocated", "elastic")))
    rows = {r["config"]: r for r in summary["rows"]}
    if changed is None:
        assert summary["unsimulated"] == []
        assert rows["elastic"]["local_prefills"]["simulated"] == 1
        return
    assert set(rows) == {"collocated"}
    [skipped] = summary["unsimulated"]
    assert (skipped["workload"], skipped["config"]) == ("chat", "elastic")
    assert f"did not stay merged in the {changed} run" in skipped["why"]
    assert f"chat  elastic  not simulated: the elastic pair did not stay merged in the " \
        f"{changed} run" in format_check(summary)


def test_a_split_row_counts_the_requests_on_the_same_path_where_routes_were_kept(results):
    chat = json.loads((results / "chat.json").read_text())
    for r in chat["disagg"]["requests"]:
        r["route"] = "local; rule=measured_cost"
    write_json(results / "chat.json", chat)
    summary = run_check(_settings(results))
    paths = {r["config"]: r for r in summary["rows"]}["disagg"]["paths"]
    n = len(chat["disagg"]["requests"])
    assert paths["compared"] == n and paths["same"] == n - len(paths["local_simulated_only"]) \
        - len(paths["local_measured_only"])
    assert not paths["local_simulated_only"]  # every request measured local
    line = format_check(summary).splitlines()[2]
    assert line.startswith("chat  disagg") and f", {paths['same']}/{n} same path  -  -" in line


def test_results_without_split_decisions_show_a_dash_for_the_measured_count(results):
    rows = {r["config"]: r for r in run_check(_settings(results))["rows"]}
    assert rows["disagg"]["local_prefills"]["measured"] is None
    simulated = rows["disagg"]["local_prefills"]["simulated"]
    summary = {"calibrated_on": "mixed", "rows": list(rows.values()), "ranking": {}}
    assert format_check(summary).splitlines()[2].endswith(f"  -/{simulated}  -  -")


def test_a_row_shows_the_calibrations_scaling_to_the_held_out_runs_speed(results):
    """Both runs timed the speed reference, the held-out one 1.2x slower: its row says so;
    with --speed-reference ignore it is priced unscaled."""
    ref = {"threads": 1, "prefill_tokens": 512}
    mixed = {"disagg": {**serve_result([request(0.0, 1000, 11)]),
                        "speed_reference": {**ref, "prefill_s": [0.5]}}}
    write_json(results / "mixed.json", mixed)
    chat = json.loads((results / "chat.json").read_text())
    chat["disagg"]["speed_reference"] = {**ref, "prefill_s": [0.6]}
    write_json(results / "chat.json", chat)
    summary = run_check(_settings(results, configs=("disagg",)))
    assert summary["rows"][0]["speed_scale"] == pytest.approx(1.2)
    assert format_check(summary).splitlines()[2].endswith("  x1.20  -")
    summary = run_check(_settings(results, configs=("disagg",), speed_reference="ignore"))
    assert summary["rows"][0]["speed_scale"] is None


def test_a_row_shows_the_decode_jobs_factor_and_split_prices_the_decode_steps_by_it(results):
    """The held-out run's prefill job 1.2x slower and its decode job 1.5x: the row shows both;
    under split its decode steps are priced by the decode job's, and the header says so."""
    ref = {"threads": 1, "prefill_tokens": 512, "decode_streams": 8, "decode_prompt_tokens": 128}
    write_json(results / "mixed.json", {"disagg": {
        **serve_result([request(0.0, 1000, 11)]),
        "speed_reference": {**ref, "prefill_s": [0.5], "decode_step_s": [0.02]}}})
    chat = json.loads((results / "chat.json").read_text())
    chat["disagg"]["speed_reference"] = {**ref, "prefill_s": [0.6], "decode_step_s": [0.03]}
    write_json(results / "chat.json", chat)
    write_json(results / "chat.steps.json", {"disagg": disagg_workers()})
    one = run_check(_settings(results, configs=("disagg",)))
    split = run_check(_settings(results, configs=("disagg",), speed_reference="split"))
    assert one["rows"][0]["decode_speed_scale"] == pytest.approx(1.5)
    assert "  x1.20, decode x1.50  decode x0.83/" in format_check(one).splitlines()[2]
    assert "  x1.20, decode x1.50  decode x0.67/" in format_check(split).splitlines()[2]
    assert "decode costs by the decode job (measured" in format_check(split).splitlines()[0]


def test_a_p99_itl_miss_shows_its_tail_and_counts_as_the_cliff_when_the_tail_is_about_1pct():
    """Both P99 ITLs miss by over 35%: one simulation put 1.2% of its ITLs above the measured
    P99 (the stalls about as many as measured, the P99 on the cliff's other side), the other
    0% (no stall at all: the model's miss)."""
    def row(config: str, above: float) -> dict:
        return {"workload": "mixed", "config": config, "measured": {"p99_itl_ms": 3000.0},
                "simulated": {"p99_itl_ms": 600.0}, "rel_error": {"p99_itl_ms": -0.8},
                "outside": ["p99_itl_ms"], "itl_above_p99": above}
    text = format_check({"calibrated_on": "diurnal", "ranking": {},
                         "rows": [row("collocated", 0.012), row("disagg", 0.0)]})
    cells = [line.split("  ") for line in text.splitlines()[1:4]]
    at = cells[0].index("itl>p99")
    assert (cells[1][at], cells[2][at]) == ("1.2%", "0.0%")
    assert text.splitlines()[-1] == ("2 of 2 figures outside their tolerance; 1 of 2 P99 ITL "
                                     "misses on the stalls' cliff (itl>p99 0.5-2%)")


def test_the_ranking_pairs_the_measured_best_with_the_others_request_by_request(tmp_path):
    """Measured: collocated met the SLO for requests 0-2, disagg for 0 and 3 (goodput 3 vs 2
    of the same 4); simulated: a tie, which goes to the first configuration, disagg. The line
    adds the pairing: 2 requests under collocated only, 1 under disagg only, which one run
    cannot tell apart (p = 1): disagg measured 33% below the best, and still agrees."""
    write_json(tmp_path / "mixed.steps.json", {"disagg": disagg_workers(),
                                               "collocated": disagg_workers()})
    write_json(tmp_path / "mixed.json", {})
    slo = {"slo_ttft_ms": 2000.0, "slo_tpot_ms": 100.0}

    def run(ttfts: list[float]) -> dict:
        reqs = [request(float(i), 100, 2, ttft_s=t) for i, t in enumerate(ttfts)]
        return {**serve_result(reqs), **slo, "request_goodput": sum(t <= 2 for t in ttfts) / 4}

    write_json(tmp_path / "chat.json", {"collocated": run([0.1, 0.1, 0.1, 9.0]),
                                        "disagg": run([0.1, 9.0, 9.0, 0.1])})
    summary = run_check(_settings(tmp_path))
    rank = summary["ranking"]["chat"]
    assert (rank["measured"], rank["simulated"]) == ("collocated", "disagg")
    assert (rank["agree"], rank["why"]) == (True, "paired")  # 33% below, but not told apart
    assert rank["paired"] == [{"a": "collocated", "b": "disagg", "only_a": 2, "only_b": 1,
                               "p": 1.0, "rounds": 1}]
    line = format_check({"calibrated_on": "mixed", "rows": [], "ranking": {"chat": rank}})
    assert line.endswith("; requests that met the SLO under the measured best only / the "
                         "other only, exact McNemar p: disagg 2/1 (p = 1)")


def test_a_held_out_run_with_its_steps_shows_them_priced_by_the_calibration(results):
    """chat.steps.json beside chat.json, the same steps as the calibration's: each kind x1.00."""
    write_json(results / "chat.steps.json", {"disagg": disagg_workers(),
                                             "collocated": disagg_workers()})
    summary = run_check(_settings(results))
    rows = {r["config"]: r for r in summary["rows"]}
    assert rows["disagg"]["step_ratios"]["decode"]["median_ratio"] == pytest.approx(1.0)
    assert format_check(summary).splitlines()[2].endswith("  decode x1.00/1.00 prompt x1.00/1.00")


def test_the_steps_cell_splits_a_decode_workers_steps_by_their_neighbour():
    row = {"workload": "mixed", "config": "disagg", "measured": {}, "simulated": {},
           "rel_error": {}, "outside": [],
           "step_ratios": {"decode": {"median_ratio": 1.16, "time_ratio": 1.22, "beside": 1.33,
                                      "alone": 1.13},
                           "mixed": {"median_ratio": 1.1, "time_ratio": 1.2}}}
    line = format_check({"calibrated_on": "diurnal", "ranking": {}, "rows": [row]})
    assert line.splitlines()[2].endswith(
        "  decode x1.16/1.22 (beside x1.33, alone x1.13) mixed x1.10/1.20")


def test_a_held_decode_context_cost_reaches_every_simulation_and_the_header(results):
    """Held at step_files' C1 on steps that record their contexts, every row is simulated and
    the header says so; on steps without contexts, simulate's refusal is raised."""
    with pytest.raises(RuntimeError, match="needs steps that record their decode context"):
        run_check(_settings(results, decode_context_us=C1 * 1e6))
    workers = {"prefill-0": prefill_steps(), "decode-0": context_decode_steps()}
    write_json(results / "mixed.steps.json", {"disagg": workers, "collocated": workers})
    summary = run_check(_settings(results, decode_context_us=C1 * 1e6))
    assert summary["decode_context"] == {"mode": "held",
                                         "us": {"disagg": C1 * 1e6, "collocated": C1 * 1e6}}
    assert len(summary["rows"]) == 2
    assert "fitted on 'mixed', decode context cost held at 10 us/token" in format_check(summary)


def _with_workers(results, monkeypatch):
    """The calibration results list each configuration's workers (disagg 2, collocated 1) and
    its steps record contexts; this process has 2 cores."""
    workers = {"prefill-0": prefill_steps(), "decode-0": context_decode_steps()}
    write_json(results / "mixed.steps.json", {"disagg": workers, "collocated": workers})
    write_json(results / "mixed.json", {"disagg": {"workers": {"prefill-0": {}, "decode-0": {}}},
                                        "collocated": {"workers": {"collocated-0": {}}}})
    monkeypatch.setattr(simulator_context, "cores", lambda: 2)


def _context_rows(us: float) -> list[dict]:
    return [{"batch": 4, "per_context_token_us": us * 0.9},
            {"batch": 8, "per_context_token_us": us * 1.1}]


def test_the_measured_context_cost_is_held_per_configuration_at_its_workers_threads(
        results, monkeypatch):
    """disagg's two workers on 2 cores compute on 1 thread each, collocated's one on 2: each
    is held at its own thread count's median, read from decode_context.json in the folder."""
    _with_workers(results, monkeypatch)
    write_json(results / simulator_context.FILE, {"model": "smollm2", "threads": {
        "1": _context_rows(12.0), "2": _context_rows(C1 * 1e6)}})
    summary = run_check(_settings(results, decode_context="measured"))
    held = summary["decode_context"]
    assert held["threads"] == {"disagg": 1, "collocated": 2}
    assert held["us"] == {"disagg": pytest.approx(12.0), "collocated": pytest.approx(C1 * 1e6)}
    assert ("decode context cost held at bench decode-context's: disagg 12 us/token (1 thread), "
            "collocated 10 us/token (2 threads)") in format_check(summary)


def test_a_thread_count_not_yet_measured_is_measured_once_and_saved(tmp_path, monkeypatch):
    calls = []

    def bench(model, threads):
        calls.append(threads)
        return _context_rows(float(threads))

    monkeypatch.setattr(simulator_context, "_bench", bench)
    write_json(tmp_path / simulator_context.FILE, {"model": "smollm2",
                                                   "threads": {"2": _context_rows(5.0)}})
    costs = simulator_context.measured_costs(tmp_path, "smollm2", {1, 2}, remeasure=False)
    assert calls == [1] and costs == {1: pytest.approx(1.0), 2: pytest.approx(5.0)}
    assert simulator_context.measured_costs(tmp_path, "smollm2", {1, 2}, False) == costs
    assert calls == [1]
    simulator_context.measured_costs(tmp_path, "smollm2", {1}, remeasure=True)
    assert calls == [1, 1]
    with pytest.raises(ValueError, match="holds 'smollm2''s context costs, not 'qwen3'"):
        simulator_context.measured_costs(tmp_path, "qwen3", {1}, False)


def test_an_elastic_pair_served_merged_computes_on_every_core():
    """Its lender's cores are lent to its one engine; a pair that was not merged has one
    core per worker, as disagg."""
    merged = {"roles": [{"role": "prefill"}], "steps": {"busy_s": 0.0}}
    decode = {"roles": [{"role": "decode"}], "steps": {"busy_s": 50.0}}
    elastic = {"workers": {"prefill-0": merged, "decode-0": decode}, "role_flips": 0,
               "core_loans": 1}
    assert simulator_context.worker_threads({"elastic": elastic}, "elastic", 2) == 2
    flipped = {**elastic, "role_flips": 1}
    assert simulator_context.worker_threads({"elastic": flipped}, "elastic", 2) == 1


def test_results_that_list_no_workers_cannot_say_their_threads():
    with pytest.raises(ValueError, match="the results of 'disagg' list no workers"):
        simulator_context.worker_threads({"disagg": {}}, "disagg", 2)
    assert simulator_context.worker_threads({"c": {"workers": {"a": {}, "b": {}}}}, "c", 5) == 2
    assert simulator_context.worker_threads({"c": {"workers": {"a": {}, "b": {}}}}, "c", 1) == 1


def test_an_agreement_also_shows_how_far_apart_the_run_put_each_configuration():
    pairs = [{"a": "disagg", "b": "collocated-chunked", "only_a": 8, "only_b": 2, "p": 0.109375},
             {"a": "disagg", "b": "collocated", "only_a": 7, "only_b": 1, "p": 0.0703125}]
    rank = {"measured": "disagg", "simulated": "disagg", "regret": 0.0, "agree": True,
            "top": 0.2, "paired": pairs}
    line = format_check({"calibrated_on": "diurnal", "rows": [], "ranking": {"mixed": rank}})
    assert line.splitlines()[-1] == (
        "mixed: best by goodput measured disagg, simulated disagg: agree; requests that met "
        "the SLO under the measured best only / the other only, exact McNemar p: "
        "collocated-chunked 8/2 (p = 0.11), collocated 7/1 (p = 0.07)")


def test_under_steps_a_row_shows_the_held_out_runs_own_speed_and_the_header_says_diagnostic(
        results):
    """The held-out run's steps ran 1.5x their price: under --speed-reference steps its row
    shows its own speed over the run and its windows' range, and the header calls it a
    diagnostic."""
    slower = {w: [[a * 1.5, b * 1.5, *rest] for a, b, *rest in rows]
              for w, rows in disagg_workers().items()}
    write_json(results / "chat.steps.json", {"disagg": slower})
    chat = json.loads((results / "chat.json").read_text())
    chat["disagg"]["run_window"] = [1500.0, 1600.0]
    write_json(results / "chat.json", chat)
    summary = run_check(_settings(results, configs=("disagg",), speed_reference="steps"))
    lines = format_check(summary).splitlines()
    assert "a diagnostic and not a prediction: each step priced at the speed the held-out " \
        "run's own steps ran at in its 2 s window" in lines[0]
    assert "  own x1.50/1.50 (x1.50-1.50)  " in lines[2]


def test_configurations_on_the_same_threads_are_calibrated_on_their_steps_pooled(
        results, monkeypatch):
    """collocated and chunked each run one worker on both cores and timed the same reference
    job: each is fitted on both runs' steps (its own first), disagg on its own; chunked's
    steps, three times as long at the same reference, then move collocated's simulation.
    --own-steps fits each on its own steps again."""
    ref = {"threads": 2, "prefill_tokens": 512, "prefill_s": [0.3]}
    one = {"workers": {"collocated-0": {}}, "speed_reference": ref}
    write_json(results / "mixed.json", {
        "disagg": {"workers": {"prefill-0": {}, "decode-0": {}},
                   "speed_reference": {**ref, "threads": 1}},
        "collocated": one, "collocated-chunked": one})
    slow = {"collocated-0": prefill_steps(0.03, 0.0006) + context_decode_steps(0.06, 0.006)}
    fast = {"collocated-0": prefill_steps() + context_decode_steps()}
    write_json(results / "mixed.steps.json", {"disagg": disagg_workers(), "collocated": fast,
                                              "collocated-chunked": slow})
    chat = json.loads((results / "chat.json").read_text())
    write_json(results / "chat.json", {**chat, "collocated-chunked": chat["collocated"]})
    monkeypatch.setattr(simulator_context, "cores", lambda: 2)
    configs = ("disagg", "collocated", "collocated-chunked")
    pooled = run_check(_settings(results, configs=configs))
    assert pooled["pools"] == {"disagg": ("disagg",),
                               "collocated": ("collocated", "collocated-chunked"),
                               "collocated-chunked": ("collocated-chunked", "collocated")}
    assert ("steps pooled: collocated+collocated-chunked, collocated-chunked+collocated"
            in format_check(pooled))
    own = run_check(_settings(results, configs=configs, own_steps=True))
    assert set(map(len, own["pools"].values())) == {1} and "pooled" not in format_check(own)
    ttft = {s["config"]: s["simulated"]["median_ttft_ms"] for s in own["rows"]}
    for row in pooled["rows"]:
        moved = row["simulated"]["median_ttft_ms"] != pytest.approx(ttft[row["config"]])
        assert moved == (row["config"] != "disagg")
