"""Pictures of a comparison (PNG, matplotlib): latency CDFs and per-worker step timelines.

- `latency_cdfs`: the empirical CDF of TTFT and of ITL per configuration, from the client-side
  per-request records (`ttft_s`, `itl_s`), log-scaled time axis.
- `step_timeline`: for each configuration, one row per worker, every engine step as a bar
  from its start to its end, coloured by what it computed (a step with prompt tokens is a
  prefill step, even when it also decodes: that is the head-of-line block). The window is a
  few seconds from the first long prefill step, so collocated serving shows decodes waiting
  behind it and disaggregated serving shows the decode row flat.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

PREFILL_COLOUR, DECODE_COLOUR = "#d62728", "#1f77b4"
LONG_PREFILL_TOKENS = 512  # a step computing at least this many prompt tokens opens the window


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def latency_cdfs(records: Mapping[str, Sequence[Mapping[str, Any]]], out_dir: Path) -> list[Path]:
    """`records[config]` is that run's per-request records; writes ttft_cdf.png, itl_cdf.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric, title in (("ttft", "time to first token"), ("itl", "inter-token latency")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, recs in records.items():
            ok = [r for r in recs if r.get("ok")]
            values = [r["ttft_s"] for r in ok] if metric == "ttft" else \
                [gap for r in ok for gap in r["itl_s"]]
            if values:
                xs, ys = _cdf([1e3 * v for v in values])
                ax.step(xs, ys, where="post", label=f"{name} (n={len(values)})")
        ax.set_xscale("log")
        ax.set_xlabel(f"{title} (ms, log scale)")
        ax.set_ylabel("fraction of " + ("requests" if metric == "ttft" else "token gaps"))
        ax.set_title(f"{title}: CDF per configuration")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right")
        path = out_dir / f"{metric}_cdf.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def _window(traces: Mapping[str, Sequence[Sequence[float]]], seconds: float
            ) -> tuple[float, float] | None:
    starts = [s[0] for steps in traces.values() for s in steps if s[2] >= LONG_PREFILL_TOKENS]
    if not starts:
        starts = [s[0] for steps in traces.values() for s in steps]
    if not starts:
        return None
    t0 = min(starts) - 0.1 * seconds
    return t0, t0 + seconds


def step_timeline(traces: Mapping[str, Mapping[str, Sequence[Sequence[float]]]], out: Path,
                  seconds: float = 4.0) -> Path:
    """`traces[config][worker]` is a list of steps [start, end, prefill_tokens, decode_tokens,
    num_requests, decode_context] (wall-clock seconds, `GET /internal/steps`; only the first
    three are read, so 5-field traces of older workers draw alike); writes one PNG."""
    rows = [(cfg, worker) for cfg, workers in traces.items() for worker in workers]
    fig, ax = plt.subplots(figsize=(10, 0.7 * len(rows) + 1.5))
    labels = []
    for y, (cfg, worker) in enumerate(rows):
        window = _window(traces[cfg], seconds)
        labels.append(f"{cfg}\n{worker}")
        if window is None:
            continue
        t0, t1 = window
        steps = [s for s in traces[cfg][worker] if s[1] > t0 and s[0] < t1]
        for kind, colour in (("prefill", PREFILL_COLOUR), ("decode", DECODE_COLOUR)):
            bars = [(s[0] - t0, s[1] - s[0]) for s in steps if (s[2] > 0) == (kind == "prefill")]
            ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=colour,
                           label=kind if y == 0 else None)
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, seconds)
    ax.set_xlabel(f"seconds from just before the first prefill of >= {LONG_PREFILL_TOKENS} "
                  "tokens (each configuration aligned on its own)")
    ax.set_title("engine steps per worker: prefill steps (red) block the decodes that share "
                 "their worker")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (PREFILL_COLOUR, DECODE_COLOUR)]
    ax.legend(handles, ["step with prompt tokens", "decode-only step"], loc="upper right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
