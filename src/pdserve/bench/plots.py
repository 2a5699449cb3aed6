"""Pictures of a comparison (PNG, matplotlib): latency CDFs and per-worker step timelines.

- `latency_cdfs`: the empirical CDF of TTFT and of ITL per configuration, from the client-side
  per-request records (`ttft_s`, `itl_s`), log-scaled time axis.
- `step_timeline`: for each configuration, one row per worker, every engine step as a bar
  from its start to its end, coloured by what it computed (a step with prompt tokens is a
  prefill step, even when it also decodes: that is the head-of-line block). The window is a
  few seconds from the first long prefill step, so collocated serving shows decodes waiting
  behind it and disaggregated serving shows the decode row flat. Given the workers' roles
  (`GET /internal/steps`'s "roles"), each lane is tinted by the worker's role over time and
  each flip in the window is marked: a line where the new role began, a hatched band over the
  drain before it, a "decode->prefill" label.
- `role_timeline`: the same lanes over a whole measured run, for configurations whose workers
  changed role (a 4-second window rarely holds a flip).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

PREFILL_COLOUR, DECODE_COLOUR, FLIP_COLOUR = "#d62728", "#1f77b4", "#000000"
ROLE_TINTS = {"prefill": "#ff9896", "decode": "#aec7e8", "collocated": "#c7c7c7"}
TINT_ALPHA = 0.35
LONG_PREFILL_TOKENS = 512  # a step computing at least this many prompt tokens opens the window
Traces = Mapping[str, Mapping[str, Sequence[Sequence[float]]]]  # config -> worker -> steps
Roles = Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]]  # config -> worker -> spans


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


def step_timeline(traces: Traces, out: Path, seconds: float = 4.0,
                  roles: Roles | None = None) -> Path:
    """`traces[config][worker]` is a list of steps [start, end, prefill_tokens, decode_tokens,
    num_requests, decode_context] (wall-clock seconds, `GET /internal/steps`; only the first
    three are read, so 5-field traces of older workers draw alike); `roles[config][worker]`,
    when given, that worker's role spans (the endpoint's "roles"): its lane is tinted by role
    and each flip inside the window marked. Writes one PNG."""
    windows = {cfg: _window(workers, seconds) for cfg, workers in traces.items()}
    fig, ax = _lanes(traces, roles or {}, windows)
    ax.set_xlim(0, seconds)
    ax.set_xlabel(f"seconds from just before the first prefill of >= {LONG_PREFILL_TOKENS} "
                  "tokens (each configuration aligned on its own)")
    ax.set_title("engine steps per worker: prefill steps (red) block the decodes that share "
                 "their worker")
    return _save(fig, out)


def role_timeline(traces: Traces, roles: Roles, windows: Mapping[str, tuple[float, float]],
                  out: Path) -> Path:
    """The whole measured run of each configuration in `windows` ((start, end) wall-clock
    seconds): every step, the lane tinted by the worker's role over time, every flip marked
    (a line where the new role began, a hatched band over the drain before it, a
    "from->to" label). Writes one PNG."""
    shown = {cfg: traces[cfg] for cfg in windows if cfg in traces}
    fig, ax = _lanes(shown, roles, windows)
    ax.set_xlim(0, max((end - start for start, end in windows.values()), default=1.0))
    ax.set_xlabel("seconds from the start of the measured run (each configuration its own)")
    ax.set_title("roles over the run: lanes tinted by role, flips marked from->to")
    return _save(fig, out)


def _lanes(traces: Traces, roles: Roles,
           windows: Mapping[str, tuple[float, float] | None]) -> tuple[Any, Any]:
    """One lane per worker of every configuration, time from its configuration's window's
    start; a configuration without a window has empty lanes."""
    rows = [(cfg, worker) for cfg, workers in traces.items() for worker in workers]
    fig, ax = plt.subplots(figsize=(10, 0.7 * len(rows) + 1.5))
    for y, (cfg, worker) in enumerate(rows):
        window = windows.get(cfg)
        if window is not None:
            spans = roles.get(cfg, {}).get(worker, ())
            _role_bands(ax, y, spans, window)
            _steps(ax, y, traces[cfg][worker], window)
            _flip_marks(ax, y, spans, window)
    ax.set_yticks(range(len(rows)), [f"{cfg}\n{worker}" for cfg, worker in rows])
    ax.invert_yaxis()
    tinted = sorted({span["role"] for cfg, worker in rows
                     for span in roles.get(cfg, {}).get(worker, ())})
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (PREFILL_COLOUR, DECODE_COLOUR)]
    handles += [plt.Rectangle((0, 0), 1, 1, color=ROLE_TINTS[r], alpha=TINT_ALPHA)
                for r in tinted]
    ax.legend(handles, ["step with prompt tokens", "decode-only step",
                        *(f"role: {r}" for r in tinted)], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return fig, ax


def _steps(ax: Any, y: int, steps: Sequence[Sequence[float]],
           window: tuple[float, float]) -> None:
    t0, t1 = window
    inside = [s for s in steps if s[1] > t0 and s[0] < t1]
    for prefill, colour in ((True, PREFILL_COLOUR), (False, DECODE_COLOUR)):
        bars = [(s[0] - t0, s[1] - s[0]) for s in inside if (s[2] > 0) == prefill]
        ax.broken_barh(bars, (y - 0.3, 0.6), facecolors=colour)


def _role_bands(ax: Any, y: int, spans: Sequence[Mapping[str, Any]],
                window: tuple[float, float]) -> None:
    """The lane's background: each role span's part inside the window, in its role's tint."""
    t0, t1 = window
    if not spans:
        return
    ends = [span["since"] for span in spans[1:]] + [t1]
    for span, until in zip(spans, ends, strict=True):
        begin, end = max(span["since"], t0), min(until, t1)
        if end > begin:
            ax.broken_barh([(begin - t0, end - begin)], (y - 0.45, 0.9),
                           facecolors=ROLE_TINTS.get(span["role"], "#dddddd"), alpha=TINT_ALPHA)


def _flip_marks(ax: Any, y: int, spans: Sequence[Mapping[str, Any]],
                window: tuple[float, float]) -> None:
    t0, t1 = window
    for span in spans:
        if span["from"] is None or not t0 <= span["since"] <= t1:
            continue
        x = span["since"] - t0
        drain = span["flip_seconds"] or 0.0
        ax.broken_barh([(x - drain, drain)], (y - 0.45, 0.9), facecolors="none",
                       edgecolors=FLIP_COLOUR, hatch="//")
        ax.vlines(x, y - 0.45, y + 0.45, colors=FLIP_COLOUR, linewidth=1.5)
        ax.text(x, y - 0.47, f"{span['from']}->{span['role']}", fontsize=7, ha="center",
                va="bottom", color=FLIP_COLOUR)


def _save(fig: Any, out: Path) -> Path:
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
