"""`pdserve bench compare --testbed`: each configuration runs across the hosts of a testbed
made for the run (the client on the router's host), the fixed split rules do what they say
(disagg-remote prefills every prompt on p0, disagg-local none), and the testbed is gone
afterwards."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pdserve.cli import main
from pdserve.testbed import namespaces as ns
from tests.testbed.conftest import skip_without_namespaces


def test_compare_runs_across_testbed_hosts_and_removes_them(tiny_model, tmp_path: Path) -> None:
    skip_without_namespaces()
    out = tmp_path / "bed.json"
    code = main(["bench", "compare", "--testbed", "--link-gbps", "1", "--model",
                 str(tiny_model()), "--configs", "disagg-remote,disagg-local", "--workload",
                 "fixed", "--input-len", "300", "--output-len", "8", "--vocab", "512",
                 "--rate", "8", "--num-requests", "4", "--out", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    for r in results.values():
        assert r["completed"] == 4 and r["failed"] == 0
        assert len(r["workers"]) == 2
        assert not any("127.0.0.1" in w["url"] for w in r["workers"].values())  # on the hosts
    steps = json.loads(out.with_suffix(".steps.json").read_text())
    # a step is [start, end, tokens computed, ...]; a prompt warmed up is mostly cached
    assert sum(s[2] for s in steps["disagg-remote"]["prefill-0"]) >= 2 * 300
    assert steps["disagg-local"]["prefill-0"] == []
    assert sum(s[2] for s in steps["disagg-local"]["decode-0"]) >= 2 * 300
    assert ns.names(f"pdc{os.getpid() % 100000}-") == []
