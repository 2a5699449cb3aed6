"""What a paced worker's ITL ceiling costs in goodput, simulated over many seeds from one measured
run: `pdserve simulate` calibrated on a `pdserve bench compare --configs collocated,elastic
--out X.json` run's steps (X.steps.json), the same trace preset replayed on

- `collocated`: one collocated worker, whole prompts (calibrated on X's collocated worker);
- `paced L`: the elastic pair merged at rest, every prompt prefilled on the decode worker in
  chunks paced beside its streams to the TPOT target with steps up to L ms
  (`--slo-itl-ms`; modelled as the disagg layout 1P+1D with `--split local`, the prefill
  worker idle, calibrated on X's elastic decode worker, which computed on both cores).

One measured run of 90 s holds ~37 long prompts, and its goodput moves by +-10% from round to
round on a shared machine; the simulation is deterministic, so seeds and long traces separate
what a choice of L costs from that noise (the simulator's agreement with such runs:
`pdserve simulate --compare-measured`, docs/benchmarks.md). It prints, per layout, the good
requests over all seeds, their ratio to collocated's, and the worst seed's P99 ITL and TPOT.

    .venv/bin/python tools/pacing/ceiling_sweep.py X.steps.json --ceilings 300,1000,inf \\
        --seeds 6 -- --workload fixed --prompt-tokens 1500 --output-tokens 96 --rate 0.4 \\
        --duration-s 600
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

MODEL = ("--model", "smollm2-135m", "--gpu", "CPU-EPYC-2CORE")
NO_CEILING_MS = 1e9  # "inf": a step beside streams may run as long as the prompt's credit


@dataclass(frozen=True)
class Outcome:
    """One simulated run's figures."""

    good: int
    requests: int
    median_ttft_ms: float
    p99_itl_ms: float
    p99_tpot_ms: float


def simulate(steps: str, config: str, layout: list[str], trace: list[str], seed: int,
             slo: list[str]) -> Outcome:
    """`pdserve simulate --json` of one layout and seed."""
    cmd = [sys.executable, "-m", "pdserve.cli", "simulate", *MODEL, "--calibrate",
           f"{steps}:{config}", *layout, *trace, "--seed", str(seed), *slo, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)}\n{out.stderr.strip()}")
    r = json.loads(out.stdout)["results"][0]
    return Outcome(r["good_requests"], r["completed"] + r["failed"], r["median_ttft_ms"],
                   r["p99_itl_ms"], r["p99_tpot_ms"])


def ceiling(text: str) -> float:
    """A ceiling in ms: a positive number, or `inf`."""
    value = NO_CEILING_MS if text.strip() == "inf" else float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a ceiling is a positive number of ms or inf: {text!r}")
    return value


def layouts(ceilings: list[float]) -> dict[str, tuple[str, list[str]]]:
    """Label -> (the steps file's configuration, simulate's layout arguments)."""
    out = {"collocated": ("collocated", ["--layouts", "colloc", "--collocated", "1"])}
    for ms in ceilings:
        label = "paced L=inf" if ms >= NO_CEILING_MS else f"paced L={ms:g} ms"
        out[label] = ("elastic", ["--layouts", "disagg", "--prefill", "1", "--decode", "1",
                                  "--split", "local", "--slo-itl-ms", f"{ms:g}"])
    return out


def row(label: str, runs: list[Outcome], base: int | None) -> str:
    good, total = sum(r.good for r in runs), sum(r.requests for r in runs)
    ratio = f"{good / base:.2f}x" if base else "-"
    return (f"{label:18s} {good:5d}/{total:<5d} {good / total:6.3f} {ratio:>7s} "
            f"{statistics.median(r.median_ttft_ms for r in runs):10,.0f} "
            f"{max(r.p99_itl_ms for r in runs):8,.0f} {max(r.p99_tpot_ms for r in runs):8,.0f}"
            f"  {[r.good for r in runs]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("steps", help="X.steps.json of a bench compare run with collocated and "
                                 "elastic")
    p.add_argument("--ceilings", default="300,1000,inf",
                   help="ITL ceilings L in ms, comma-separated, inf for none (default: "
                        "300,1000,inf)")
    p.add_argument("--seeds", type=int, default=6, help="trace seeds 0..N-1 (default: 6)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, trace = p.parse_args(argv[:cut]), argv[cut + 1:]  # after --: simulate's trace
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    if not trace:
        p.error("give the trace after --, e.g. -- --workload fixed --prompt-tokens 1500 "
                "--output-tokens 96 --rate 0.4 --duration-s 600")
    ceilings = [ceiling(t) for t in args.ceilings.split(",")]
    slo = ["--slo-ttft-ms", f"{args.slo_ttft_ms:g}", "--slo-tpot-ms", f"{args.slo_tpot_ms:g}"]
    print(f"{'layout':18s} {'good/all':>11s} {'share':>6s} {'ratio':>7s} {'med TTFT':>10s} "
          f"{'P99 ITL':>8s} {'P99 TPOT':>8s}  good per seed (worst seed's P99s)")
    base = None
    with ThreadPoolExecutor(2) as pool:
        for label, (config, layout) in layouts(ceilings).items():
            runs = list(pool.map(lambda s, c=config, lay=layout:
                                 simulate(args.steps, c, lay, trace, s, slo), range(args.seeds)))
            print(row(label, runs, base), flush=True)
            if base is None:
                base = sum(r.good for r in runs) or None


if __name__ == "__main__":
    main()
