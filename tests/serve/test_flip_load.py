"""Live role flips under load, through `pdserve bench flip`'s own run (one code path): `pdserve up
--prefill 1 --decode 2` with a tiny model, 16 concurrent greedy streams, and one decode worker
flipped decode -> prefill -> decode 20 times through the router's signed flip endpoint. No
request fails, every output equals its prompt's output from the pass without flips, and no
worker holds a KV block once idle."""

from __future__ import annotations

import json

from pdserve.bench.flip.cli import FlipSettings
from pdserve.bench.flip.run import run

FLIPS = 20
# short prompts and outputs: the run fits in well under a minute on 2 cores; prompts over the
# threshold are split, so the worker does prefill work between its flips
UP_ARGS = ("--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "512",
           "--local-prefill-threshold", "16")


def test_flips_under_load_fail_nothing_change_no_output_and_leak_no_block(tiny_model) -> None:
    report = run(FlipSettings(model=str(tiny_model()), prefill=1, decode=2, streams=16,
                              flips=FLIPS, max_tokens=16, prompt_tokens=24, prompts=32,
                              pause_s=0.2, settle_s=20.0, up_args=UP_ARGS))
    flips = [(f["from_role"], f["to_role"], f["status"]) for f in report["flips"]]
    assert flips == [("decode", "prefill", "done"), ("prefill", "decode", "done")] * (FLIPS // 2)
    assert report["failed"] == 0, report["errors"]
    assert report["requests_across_flips"] > 0 and report["ok"] == report["requests"]
    # streams were handed back (their KV parked, then resumed elsewhere), not waited for
    assert report["streams_moved"].get("handed back by a worker changing role", 0) > 0
    # the whole mismatch (prompt, flips in flight, expected and got), not pytest's shortened repr
    assert report["mismatches"] == 0, json.dumps(report["first_mismatch"])
    assert report["blocks_by_worker"] == {"prefill-0": 0, "decode-0": 0, "decode-1": 0}
    # back in the decode role it served again between its flips (as a prefill worker it gets
    # work only from prompts the router splits, which the decode workers' caches may keep)
    assert "decode" in {f["to_role"] for f in report["flips"] if f["first_step_s"] is not None}
