"""`pdserve bench compare` keeps the router's split decisions of each run: read from its
/metrics after the warm-up and after the run, the difference by path and reason; a row of the
table and a line of reasons for the configurations that split prompts; medians over repeats.
The warm-up sends none of the trace's prompts (no prefix hit the simulator would not see), and
says what it served (the simulator serves the same before the run)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from pdserve.bench.compare import (
    METRIC_KEYS,
    WARM_UP_TOKENS,
    cluster_figures,
    combine_repeats,
    format_table,
    serve_warm_up,
    split_counts,
    split_decisions,
    warm_up_requests,
)
from pdserve.bench.serve.workloads import Workload
from tests.http_app import serving

SPLITS = "pdserve_router_split_decisions_total"
# after the warm-up: one request split before any rate was measured, one kept local
BEFORE = f"""# HELP {SPLITS} Requests by the path chosen.
# TYPE {SPLITS} counter
{SPLITS}{{path="disaggregated",reason="unmeasured"}} 1
{SPLITS}{{path="local",reason="measured_cost"}} 1
"""
AFTER = f"""# TYPE {SPLITS} counter
{SPLITS}{{path="disaggregated",reason="unmeasured"}} 1
{SPLITS}{{path="local",reason="measured_cost"}} 2
{SPLITS}{{path="disaggregated",reason="measured_cost"}} 17
{SPLITS}{{path="disaggregated",reason="tpot_target"}} 1
pdserve_router_split_estimate_seconds_count{{path="local"}} 20
pdserve_role_flips_total{{from="decode",to="prefill"}} 2
"""
COLLOCATED = f'{SPLITS}{{path="local",reason="collocated_worker"}} 21\n'


def test_split_counts_are_read_by_path_and_reason() -> None:
    assert split_counts(AFTER) == {"remote/unmeasured": 1, "local/measured_cost": 2,
                                   "remote/measured_cost": 17, "remote/tpot_target": 1}
    assert split_counts("") == {}


def test_a_runs_split_decisions_are_those_after_the_warm_up() -> None:
    figures = cluster_figures(AFTER, split_counts(BEFORE))
    assert figures["split_decisions"] == {
        "local": 1, "remote": 18,
        "by_reason": {"local/measured_cost": 1, "remote/measured_cost": 17,
                      "remote/tpot_target": 1}}
    assert figures["role_flips"] == 2 and figures["role_flips_by"] == {"decode->prefill": 2}


def test_a_collocated_workers_requests_are_no_split_decisions() -> None:
    figures = cluster_figures(COLLOCATED, {})
    assert figures["split_decisions"] == {"local": 0, "remote": 0, "by_reason": {}}
    assert figures["role_flips"] == 0


def _results() -> dict[str, dict]:
    return {"collocated": {"completed": 19, **cluster_figures(COLLOCATED, {})},
            "disagg": {"completed": 19, **cluster_figures(AFTER, split_counts(BEFORE))},
            "vllm": {"completed": 19}}


def test_the_table_has_a_split_row_and_reasons_only_when_a_configuration_split() -> None:
    lines = format_table(_results()).splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("split local/remote"))
    assert lines[i].split()[2:] == ["-", "1/18", "-"]
    assert lines[i - 2].startswith("role_flips") and lines[i - 1].startswith("core_loans")
    assert lines[i + 1].startswith("ratios are to")
    assert "  disagg: local/measured_cost 1, remote/measured_cost 17, remote/tpot_target 1" \
        in lines
    unsplit = format_table({n: r for n, r in _results().items() if n != "disagg"})
    assert "split" not in unsplit


def test_repeats_keep_each_runs_decisions_and_give_the_median_of_each_count() -> None:
    def run(local: int, remote: int, threshold: int = 0) -> dict:
        by = {"local/measured_cost": local, "remote/measured_cost": remote,
              "remote/unmeasured": threshold}
        return {**dict.fromkeys(METRIC_KEYS, 1.0), "errors": [],
                "split_decisions": split_decisions(by)}

    runs = [run(1, 18), run(9, 10, threshold=1), run(3, 16)]
    combined = combine_repeats(runs)
    assert [r["split_decisions"]["local"] for r in combined["repeats"]] == [1, 9, 3]
    assert combined["split_decisions"] == {
        "local": 3, "remote": 16,
        "by_reason": {"local/measured_cost": 3, "remote/measured_cost": 16}}
    external = combine_repeats([{**dict.fromkeys(METRIC_KEYS, 1.0), "errors": []}] * 2)
    assert "split_decisions" not in external and "split_decisions" not in external["repeats"][0]


def test_the_warm_up_sends_none_of_the_traces_prompts() -> None:
    for kind in ("rag", "chat", "mixed"):
        workload = Workload(kind=kind)
        trace = {spec.prompt_token_ids for spec in workload.requests(1.0, duration_s=60.0)}
        warm = warm_up_requests(workload)
        assert len(warm) == 2 and not trace & {spec.prompt_token_ids for spec in warm}


def test_the_warm_up_says_what_it_served() -> None:
    """Each request's prompt and the tokens its usage counted (one stopped early here)."""
    workload, seen = Workload(kind="chat"), []

    async def completions(request: web.Request) -> web.Response:
        body: dict[str, Any] = await request.json()
        seen.append(body)
        return web.json_response({"usage": {"completion_tokens": 2 if len(seen) == 1 else 4}})

    async def go() -> list[dict[str, int]]:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        async with serving(app) as base:
            return await asyncio.to_thread(serve_warm_up, base + "/v1", "m", workload)

    served = asyncio.run(go())
    sent = [spec.prompt_token_ids for spec in warm_up_requests(workload)]
    assert [tuple(b["prompt"]) for b in seen] == sent
    assert all(b["max_tokens"] == WARM_UP_TOKENS for b in seen)
    assert served == [{"prompt_tokens": len(sent[0]), "output_tokens": 2},
                      {"prompt_tokens": len(sent[1]), "output_tokens": 4}]
