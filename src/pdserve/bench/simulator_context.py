"""The decode cost per context token each configuration of `pdserve bench simulator` is held at.

A serving run cannot tell the decode cost of one context token from the cost of one stream
where its long contexts all come in steps of many streams (planner/simulate/step_fit.py): the
fit then charges one for the other, right for the run it was fitted on and wrong out of sample.
So by default the held-out check holds it at what `pdserve bench decode-context` measures in the
engine alone, on as many threads as the configuration's workers compute on:

    threads = max(1, cores // workers)

cores: this process's (`bench compare` gives every configuration all of them, split in order
among its workers: `pdserve up`'s worker_cores); workers: those the configuration's results
list. A collocated worker on 2 cores computes on 2 threads; a disaggregated pair on 1 each (an
elastic pair served merged on 2: its one engine has the lender's cores too), and one thread pays
two to three times per token what two do. Each thread count is measured once, in the same folder
as the runs (decode_context.json, reused like them), and the value held is the median over the
bench's batches of its per-context-token cost.

Modes: "measured" (the above), "fitted" (step_fit's own fit on the calibration run), or one
number for every configuration (`--decode-context-us`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdserve.planner.simulate.measured_run import served_merged

MODES = ("measured", "fitted")
FILE = "decode_context.json"


def worker_threads(results: Mapping[str, Any], config: str, cores: int) -> int:
    """The threads each worker of `config` computed on in `results` (a bench compare file):
    the cores over the workers it lists; all the cores for an elastic pair served merged
    (measured_run.served_merged), whose one engine has its lender's cores too."""
    workers = results.get(config, {}).get("workers")
    if not workers:
        raise ValueError(f"the results of {config!r} list no workers, so their threads are "
                         "unknown; hold the context cost with --decode-context-us or fit it "
                         "(--decode-context fitted)")
    if served_merged(results[config]):
        return cores
    return max(1, cores // len(workers))


def measured_costs(out_dir: Path, model: str, threads: set[int], remeasure: bool
                   ) -> dict[int, float]:
    """Microseconds per context token by thread count, from out_dir/decode_context.json or
    measured now for the counts it lacks (all of them with `remeasure`)."""
    path = out_dir / FILE
    saved: dict[str, Any] = {} if remeasure or not path.exists() else json.loads(
        path.read_text())
    if saved.get("model", model) != model:
        raise ValueError(f"{path} holds {saved['model']!r}'s context costs, not {model!r}'s; "
                         "use another --out or --remeasure")
    rows = {int(t): r for t, r in saved.get("threads", {}).items()}
    for t in sorted(threads - rows.keys()):
        rows[t] = _bench(model, t)
    path.write_text(json.dumps({"model": model, "threads": {str(t): r for t, r in
                                                            sorted(rows.items())}}, indent=1))
    return {t: statistics.median(r["per_context_token_us"] for r in rows[t]) for t in threads}


def _bench(model: str, threads: int) -> list[dict[str, Any]]:
    """`pdserve bench decode-context --threads T --json`'s rows."""
    argv = [sys.executable, "-m", "pdserve.cli", "bench", "decode-context", "--model", model,
            "--threads", str(threads), "--json"]
    print(f"decode context cost: measuring ({' '.join(argv[3:])})", file=sys.stderr, flush=True)
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench decode-context failed on {threads} threads (exit "
                           f"{done.returncode})")
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def cores() -> int:
    return len(os.sched_getaffinity(0))
