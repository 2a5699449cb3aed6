"""Where a simulated median ITL falls in a measured run's gaps: the measured ITL percentiles of
one configuration of a `pdserve bench compare --out X.json` run (its `requests`' token gaps,
the last round's), and for each value given with --at, the share of measured gaps below it.

A median between two modes of the gaps (decode steps of one stream, and of two or beside a
computing neighbour) moves far with a small shift of mass between the modes: the check's 25%
on a median ITL is then a test of that mass, not of the step costs. The quantile a simulated
median lands at says how far off in mass it is (50: exactly the measured median).

    .venv/bin/python tools/steps/itl_quantiles.py X.json --config disagg --at 18.1 24.4
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from pathlib import Path

PERCENTILES = (10, 20, 30, 40, 45, 50, 55, 60, 70, 80, 90)


def gaps_ms(path: Path, config: str) -> list[float]:
    """Every request's token gaps, in ms, sorted."""
    result = json.loads(path.read_text())[config]
    return sorted(g * 1e3 for r in result["requests"] for g in (r.get("itl_s") or []))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="a bench compare X.json")
    p.add_argument("--config", default="disagg", help="the configuration (default: disagg)")
    p.add_argument("--at", type=float, nargs="*", default=[], metavar="MS",
                   help="ITLs (ms) whose measured quantile to print")
    args = p.parse_args()
    gaps = gaps_ms(args.results, args.config)
    if len(gaps) < 2:
        raise SystemExit(f"{args.results}:{args.config} has fewer than two token gaps")
    cuts = statistics.quantiles(gaps, n=100)  # cuts[k - 1]: the k-th percentile
    print(f"{args.results}:{args.config}: {len(gaps)} gaps; ITL percentiles (ms): " +
          ", ".join(f"P{k} {cuts[k - 1]:.1f}" for k in PERCENTILES))
    for ms in args.at:
        share = bisect.bisect_left(gaps, ms) / len(gaps)
        print(f"  {ms:g} ms: above {share:.0%} of the measured gaps")


if __name__ == "__main__":
    main()
