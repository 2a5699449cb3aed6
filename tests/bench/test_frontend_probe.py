"""The idle probes `bench compare` sends after a run: a few one-token requests, each with its own
prompt, through bench serve's streaming client, their TTFTs kept (failed ones left out)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.bench.compare import probe_steps
from pdserve.bench.frontend_probe import PROBE_TOKENS, PROBES, probe_async, probe_requests
from pdserve.planner.simulate.measured_run import load_measured_run
from tests.bench.test_serve_client import TTFT_S, fake_server
from tests.planner.simulate.step_files import request, serve_result, write_json


def test_each_probe_is_a_one_token_request_with_its_own_prompt():
    specs = probe_requests()
    assert len(specs) == PROBES and all(s.max_tokens == 1 for s in specs)
    assert all(len(s.prompt_token_ids) == PROBE_TOKENS for s in specs)
    assert len({s.prompt_token_ids for s in specs}) == PROBES
    assert probe_requests() == specs  # the same prompts in every run


def test_the_probes_ttfts_are_what_the_server_took():
    async def go(model: str):
        async with fake_server() as (url, seen):
            return await probe_async(url, model), seen.bodies

    ttfts, bodies = asyncio.run(go("ok"))
    assert len(ttfts) == PROBES and all(TTFT_S * 0.9 <= t <= TTFT_S + 1.0 for t in ttfts)
    assert [b["max_tokens"] for b in bodies] == [1] * PROBES
    assert [b["prompt"] for b in bodies] == [list(s.prompt_token_ids) for s in probe_requests()]
    failed, _ = asyncio.run(go("http400"))
    assert failed == []


@pytest.mark.parametrize("probe", [{"prompt_tokens": 0, "ttft_s": [0.1]},
                                   {"prompt_tokens": 32, "ttft_s": [-1.0]},
                                   {"prompt_tokens": 32}, [1, 2]])
def test_a_bad_probe_entry_says_what_is_wrong(tmp_path, probe):
    result = {**serve_result([request(0.0, 100, 4)]), "frontend_probe": probe}
    path = write_json(tmp_path / "r.json", {"collocated": result})
    with pytest.raises(ValueError, match="frontend_probe must be"):
        load_measured_run(f"{path}:collocated", "x")


def test_the_probes_own_steps_pair_with_their_ttfts_or_are_left_out(tmp_path):
    """step_s (compare.probe_steps: the workers' steps of 32 prompt tokens and no stream after
    the run, in order) is kept when there is one per TTFT; a probe whose step is missing
    leaves them all out, and the front end is then fitted from the costs."""
    def run(probe: dict):
        result = {**serve_result([request(0.0, 100, 4)]), "frontend_probe": probe}
        return load_measured_run(f"{write_json(tmp_path / 'r.json', {'c': result})}:c", "x")
    base = {"prompt_tokens": 32, "ttft_s": [0.03, 0.04]}
    assert run({**base, "step_s": [0.025, 0.027]}).probe_steps_s == (0.025, 0.027)
    assert run({**base, "step_s": [0.025]}).probe_steps_s == ()
    assert run(base).probe_steps_s == ()
    with pytest.raises(ValueError, match="frontend_probe's step_s must be"):
        run({**base, "step_s": [0.025, -1.0]})


def test_the_probes_steps_are_their_prompt_steps_after_the_run_in_order():
    rows = [[11.0, 11.1, 0, 1, 1, 40, 0], [10.0, 10.03, 32, 0, 1, 0, 528],
            [9.0, 9.02, 32, 0, 1, 0, 528], [12.0, 12.5, 300, 0, 1, 0, 45150]]
    assert probe_steps(rows) == pytest.approx([0.02, 0.03])
