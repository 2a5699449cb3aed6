"""What a KV hand-over adds to a split request, from a `pdserve bench compare --out X.json`
run's requests (the last round's): a split request's token 0 comes from its prefill worker,
and its token 1 from its decode worker once the KV arrived there, so its first token gap holds
the hand-over; a request prefilled locally has none. Per path (the `X-Pdserve-Route` header
bench serve records: disaggregated or local), the median first gap, the median of each
request's later gaps, and their difference: the first gap's excess, what `pdserve simulate
--link-fixed-ms` adds to every hand-over.

    .venv/bin/python tools/steps/first_gap.py X.json [--config disagg]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

PATHS = ("disaggregated", "local")


def gaps_by_path(requests: list[dict[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """Per path: (first gaps, each request's median later gap), in seconds, of the requests
    that completed with at least three gaps."""
    out: dict[str, tuple[list[float], list[float]]] = {p: ([], []) for p in PATHS}
    for r in requests:
        gaps, route = r.get("itl_s") or [], (r.get("route") or "").split(";")[0]
        if r.get("ok", True) and route in out and len(gaps) >= 3:
            out[route][0].append(gaps[0])
            out[route][1].append(statistics.median(gaps[1:]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="a bench compare X.json")
    p.add_argument("--config", default="disagg", help="the configuration (default: disagg)")
    args = p.parse_args()
    requests = json.loads(args.results.read_text())[args.config]["requests"]
    for path, (first, later) in gaps_by_path(requests).items():
        if not first:
            print(f"{path}: no request with three gaps")
            continue
        a, b = statistics.median(first), statistics.median(later)
        print(f"{path}: {len(first)} requests, first gap {a * 1e3:.0f} ms, later gaps "
              f"{b * 1e3:.0f} ms, excess {(a - b) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
