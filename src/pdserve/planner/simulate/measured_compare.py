"""Simulated vs measured: does a calibrated simulation predict a real run?

The simulated layout must be the measured configuration's. `pdserve bench compare` names its
configurations (bench/compare.py CONFIGS) and starts each with pdserve's engine defaults, so a
known name fixes the layout and the per-worker limits (`PDSERVE_CONFIGS`):
  disagg -> disagg, 1 prefill + 1 decode worker, prompts routed by the router's measured
  costs (split_model.py: measured); disagg-local and disagg-remote -> the same workers with
  every prompt prefilled on the decode worker (local) or on the prefill worker (remote), as
  their `--local-prefill-threshold` does; collocated -> colloc, 1 worker;
  collocated-chunked -> chunked, 1 worker; elastic -> disagg-local's layout where the run
  was served merged throughout (measured_run.served_merged: the pair's prefill worker lent its
  cores at rest and computed nothing, one engine on both sets of cores prefilled every prompt
  in chunks paced beside its streams), and no layout where the controller flipped a role,
  took the cores back, or the prefill worker computed (a layout that changes during the run is
  not simulated);
  each with max batch 64 (EngineConfig.max_num_seqs, `pdserve up --max-num-seqs`), chunks of
  512 tokens (engine.py DEFAULT_CHUNK_TOKENS) and KV of 512 MiB per worker (`pdserve up
  --kv-cache-memory`), i.e. 512 MiB // KV bytes per token per GPU tokens.
Any other run (a `bench serve` result, an external server) takes its layout from --layouts,
which must then name exactly one, and its limits from the flags. A flag given explicitly
always wins over a configuration's default.

Relative error = (simulated - measured) / measured, for each of METRICS (None when the
measured value is 0 or missing). Each figure has its tolerance: 35% for the P99 ITL (a tail of
single steps, the hardest to place), 25% for the others; `worst` is the largest |relative
error| as a share of its tolerance (<= 1: every figure within).

A split layout's comparison also shows its local prefills, informational (no tolerance): the
prompts the router kept on their decode worker (the run's `split_decisions`, bench compare;
"-" for a file without them) beside the simulation's `local_prefills` (split_model.py's rule),
and, where the run's requests hold the router's route header, how many requests took the same
path in both and the prompt sizes of those that did not (path_agreement.py).
With a calibration profile and the run's steps beside its results (X.steps.json beside X.json),
the comparison also prices those steps by the profile (step_check.py): how far the costs are
from this run's own steps, per kind, which tells a miss of the costs from one of the
scheduling. Failed requests are shown the same way, informational, whenever either side has any: the
measured run's (every request that ended in an error, the router's refusals among them) beside
the simulation's (those its admission refused, admission.py; none without admission). The
JSON holds them always. When both runs carry bench compare's speed reference, the calibration
is priced at the measured run's speed first (speed_scale.py) and the comparison says by what
factor (`speed_scale` in the JSON; null: not scaled), with the decode job's factor beside it
(`decode_speed_scale`, null where a run did not time it; `speed_split` true when the decode
costs were priced by it, `--speed-reference split`).

The P99 ITL also has its tail: the share of the simulated ITLs longer than the measured P99
(`itl_above_p99`; 1% where the two agree). A run whose decodes stall behind whole prompts puts
its stalls (seconds) and its steady steps (tens of ms) on either side of a cliff, and its P99
lands on one side or the other by whether the stalls are a little more or less than 1% of the
ITLs; a simulation with about as many stalls (0.5-2%: within a factor of two) then misses the
P99 by the cliff's height, while one with none (0%) or many (several %) is a miss of the
model. Informational: the P99's tolerance is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.planner.simulate.cluster import Layout
from pdserve.planner.simulate.events import SimResult
from pdserve.planner.simulate.measured_run import METRICS, NOT_MERGED, MeasuredRun
from pdserve.planner.simulate.metrics import ItlSamples
from pdserve.planner.simulate.path_agreement import PathAgreement, agreement
from pdserve.planner.simulate.speed_scale import SpeedScale
from pdserve.planner.simulate.speed_timeline import SpeedTimeline
from pdserve.planner.simulate.split_model import SplitRule
from pdserve.planner.simulate.step_check import describe_ratios

PDSERVE_MAX_NUM_SEQS = 64
PDSERVE_CHUNK_TOKENS = 512
PDSERVE_KV_CACHE_BYTES = 512 * 2**20
TOLERANCE = 0.25  # calibrated on one run, a held-out run's figures within 25% ...
TOLERANCES = {key: 0.35 if key == "p99_itl_ms" else TOLERANCE for key in METRICS}  # P99 ITL 35%
CLIFF_TAIL = (0.005, 0.02)  # simulated ITLs above the measured P99: 1% within a factor of two
CLIFF_TEXT = f"{CLIFF_TAIL[0] * 100:g}-{CLIFF_TAIL[1] * 100:g}%"  # "0.5-2%"


def on_the_cliff(itl_above_p99: float | None) -> bool:
    """The simulation has about the measured run's 1% of ITLs above its P99 (CLIFF_TAIL)."""
    return itl_above_p99 is not None and CLIFF_TAIL[0] <= itl_above_p99 <= CLIFF_TAIL[1]


@dataclass(frozen=True)
class MeasuredLayout:
    """How a measured run was served; None: the flag's value (or the simulator's default)."""

    layout: Layout
    prefill_workers: int | None = None
    decode_workers: int | None = None
    collocated_workers: int | None = None
    max_batch: int | None = None
    chunk_tokens: int | None = None
    kv_cache_bytes: int | None = None
    split: SplitRule | None = None  # a split layout's routing rule (split_model.py)


def _pdserve(layout: Layout, split: SplitRule | None = None, **workers: int) -> MeasuredLayout:
    return MeasuredLayout(layout, **workers, split=split, max_batch=PDSERVE_MAX_NUM_SEQS,
                          chunk_tokens=PDSERVE_CHUNK_TOKENS,
                          kv_cache_bytes=PDSERVE_KV_CACHE_BYTES)


PDSERVE_CONFIGS: dict[str, MeasuredLayout] = {
    "disagg": _pdserve(Layout.DISAGG, prefill_workers=1, decode_workers=1,
                       split=SplitRule.MEASURED),
    "disagg-local": _pdserve(Layout.DISAGG, prefill_workers=1, decode_workers=1,
                             split=SplitRule.LOCAL),
    "disagg-remote": _pdserve(Layout.DISAGG, prefill_workers=1, decode_workers=1,
                              split=SplitRule.REMOTE),
    "collocated": _pdserve(Layout.COLLOC, collocated_workers=1),
    "collocated-chunked": _pdserve(Layout.CHUNKED, collocated_workers=1),
    "collocated-2": _pdserve(Layout.COLLOC, collocated_workers=2),
}
ELASTIC = "elastic"  # bench compare's elastic pair: simulated as MERGED while it stays merged
MERGED = PDSERVE_CONFIGS["disagg-local"]  # the prefill worker idle, its cores the decode's


def pdserve_layout(run: MeasuredRun) -> MeasuredLayout | None:
    """The layout a bench compare configuration fixes (its router's admission with it); None
    for another run, or an elastic one that did not stay merged."""
    if run.config == ELASTIC:
        return MERGED if run.merged else None
    return PDSERVE_CONFIGS.get(run.config or "")


def measured_layout(run: MeasuredRun, layouts: tuple[Layout, ...] | None) -> MeasuredLayout:
    """The run's layout from its configuration name, else from `layouts` (--layouts)."""
    known = pdserve_layout(run)
    if known is not None:
        if layouts is not None and layouts != (known.layout,):
            raise ValueError(f"--layouts {','.join(layouts)} does not match {run.label}: bench "
                             f"compare's {run.config!r} is {known.layout}; drop --layouts")
        return known
    if layouts is None or len(layouts) != 1:
        name = f"configuration {run.config!r}" if run.config else "a bench serve result"
        why = (f" (its pair was not served merged throughout: {NOT_MERGED}, and a layout "
               "that changes during the run is not simulated)" if run.config == ELASTIC else "")
        raise ValueError(f"compare_measured (--compare-measured) {run.label}: {name} does not "
                         f"say how it was served{why}; pass --layouts with one of "
                         f"{', '.join(Layout)} (and the worker counts)")
    return MeasuredLayout(layouts[0])


@dataclass(frozen=True)
class Comparison:
    """Measured and simulated figures by vLLM key (METRICS), and their relative errors."""

    run: MeasuredRun
    label: str  # the simulated layout, e.g. "disagg 1P+1D"
    measured: dict[str, float | None]
    simulated: dict[str, float | None]
    # the simulation's prompts prefilled on their decode worker; None: not a split layout
    local_prefills: int | None = None
    failed: int = 0  # the simulation's requests refused by admission
    # the measured run's steps priced by the calibration (step_check.py); None: not known
    step_ratios: dict[str, dict[str, Any]] | None = None
    # the calibration's factors to the measured run's speed (speed_scale.py); None: not scaled
    speed_scale: SpeedScale | None = None
    # a split layout's paths request by request (path_agreement.py); None: not known
    paths: PathAgreement | None = None
    # the share of the simulated ITLs longer than the measured P99 ITL; None: not known
    itl_above_p99: float | None = None
    # --speed-reference steps: the run's own speed by window it was priced at; None: not so
    speed_timeline: SpeedTimeline | None = None

    def error(self, key: str) -> float | None:
        m, s = self.measured[key], self.simulated[key]
        return None if m is None or s is None or m == 0 else (s - m) / m

    @property
    def worst(self) -> float | None:
        """The largest |relative error| / its tolerance (None: no figure to compare)."""
        shares = [abs(e) / TOLERANCES[k] for k in METRICS if (e := self.error(k)) is not None]
        return max(shares) if shares else None


def compare(run: MeasuredRun, label: str, simulated: dict[str, Any],
            local_prefills: int | None = None,
            step_ratios: dict[str, dict[str, Any]] | None = None,
            speed_scale: SpeedScale | None = None, paths: PathAgreement | None = None,
            itl: ItlSamples | None = None, speed_timeline: SpeedTimeline | None = None
            ) -> Comparison:
    """`simulated`: metrics.summary_to_dict of the simulated layout (its "failed" count of
    refused requests, 0 when absent); `local_prefills`: its local prefills when it splits
    prompts (`split_local_prefills`); `step_ratios`: step_check.step_ratios of the run;
    `speed_scale`: the factors the calibration was scaled by to the run's speed; `paths`: the
    split paths request by request (`split_paths`); `itl`: the simulation's ITLs;
    `speed_timeline`: the run's own speed the simulation was priced at (speed_timeline.py)."""
    p99 = run.measured["p99_itl_ms"]
    above = None if itl is None or p99 is None else itl.share_above(p99)
    return Comparison(run, label, {k: run.measured[k] for k in METRICS},
                      {k: simulated[k] for k in METRICS}, local_prefills,
                      simulated.get("failed", 0), step_ratios, speed_scale, paths, above,
                      speed_timeline)


def split_local_prefills(result: SimResult) -> int | None:
    """The simulation's local prefills for a split layout (disagg), else None."""
    return result.local_prefills if result.layout is Layout.DISAGG else None


def split_paths(run: MeasuredRun, result: SimResult) -> PathAgreement | None:
    """A split layout's paths, the run's against the simulation's, when the run has them."""
    if result.layout is not Layout.DISAGG or not run.paths:
        return None
    return agreement(run.paths, result.records)


def _speed_line(scale: SpeedScale) -> str:
    """"calibration scaled x1.030 to the run's speed reference (its decode job: x1.200, not
    applied)", or the two factors as applied under split."""
    if scale.split:
        return (f"calibration scaled to the run's speed references: prompt costs "
                f"x{scale.prefill:.3f} (prefill job), decode costs x{scale.decode:.3f} "
                "(decode job)")
    decode = "" if scale.decode is None else \
        f" (its decode job: x{scale.decode:.3f}, not applied)"
    return f"calibration scaled x{scale.prefill:.3f} to the run's speed reference{decode}"


def _timeline_line(t: SpeedTimeline) -> str:
    """How the run's own speed priced it, as a diagnostic (speed_timeline.py)."""
    low, high = t.spread()
    return (f"priced at the run's own steps' speed by {t.window_s:g} s window (a diagnostic, "
            f"not a prediction: read from the run predicted): x{low:.2f}-{high:.2f}; over the "
            f"run, prompt steps x{t.prompt_run:.2f}, decode x{t.decode_run:.2f}")


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def render_comparison(c: Comparison) -> str:
    """A small table: one row per metric, measured / simulated / relative error."""
    run = c.run
    lines = [f"measured run {run.label} ({run.completed} ok, {run.failed} failed) vs "
             f"simulated {c.label}",
             f"{'metric':<22}{'measured':>12}{'simulated':>12}{'error':>10}"]
    for key in METRICS:
        lines.append(f"{_LABELS[key]:<22}{_cell(c.measured[key], '{:,.2f}'):>12}"
                     f"{_cell(c.simulated[key], '{:,.2f}'):>12}"
                     f"{_cell(c.error(key), '{:+.1%}'):>10}  (within {TOLERANCES[key]:.0%})")
    if c.itl_above_p99 is not None:
        lines.append(f"simulated ITLs above the measured P99 ITL: {c.itl_above_p99:.2%} "
                     f"(measured: 1%; {'within' if on_the_cliff(c.itl_above_p99) else 'outside'} "
                     f"{CLIFF_TEXT}, where a P99 miss is the stalls' cliff, not the model's)")
    if c.local_prefills is not None:
        lines.append(f"{'local prefills':<22}{_cell(c.run.local_prefills, '{:g}'):>12}"
                     f"{c.local_prefills:>12}{'':>10}  (measured: the router's; no tolerance)")
    if c.paths is not None:
        lines.append(f"paths: {c.paths.describe()}")
    if run.failed or c.failed:
        lines.append(f"{'failed requests':<22}{run.failed:>12,}{c.failed:>12,}{'':>10}  "
                     "(simulated: refused by admission; no tolerance)")
    if c.speed_scale is not None:
        lines.append(_speed_line(c.speed_scale))
    if c.speed_timeline is not None:
        lines.append(_timeline_line(c.speed_timeline))
    if c.step_ratios:
        lines.append(f"its steps, measured / priced by the calibration: "
                     f"{describe_ratios(c.step_ratios)}")
    if c.worst is not None:
        verdict = "every figure within its tolerance" if c.worst <= 1 else \
            "NOT every figure within its tolerance"
        lines.append(f"largest |error| / tolerance {c.worst:.2f}: {verdict}")
    return "\n".join(lines)


_LABELS = {"median_ttft_ms": "median TTFT (ms)", "p99_ttft_ms": "P99 TTFT (ms)",
           "median_itl_ms": "median ITL (ms)", "p99_itl_ms": "P99 ITL (ms)",
           "request_goodput": "goodput (req/s)", "output_throughput": "output (tok/s)"}


def comparison_json(c: Comparison) -> dict[str, Any]:
    """The comparison; `completed` and `failed` are the measured run's, `failed_requests` sets
    them beside the simulation's refusals; `local_prefills` ({"measured": n or None,
    "simulated": m}) only for a split layout, and `paths` (PathAgreement.to_json) only for
    one whose run has its requests' routes; `speed_timeline` (its factors by window and over
    the run) only under --speed-reference steps."""
    out = {"run": c.run.label, "config": c.run.config, "layout": c.label,
           "completed": c.run.completed, "failed": c.run.failed,
           "failed_requests": {"measured": c.run.failed, "simulated": c.failed},
           "measured": c.measured, "simulated": c.simulated,
           "rel_error": {k: c.error(k) for k in METRICS}, "tolerance": TOLERANCES,
           "worst_share_of_tolerance": c.worst, "itl_above_p99": c.itl_above_p99}
    if c.local_prefills is not None:
        out["local_prefills"] = {"measured": c.run.local_prefills,
                                 "simulated": c.local_prefills}
    if c.paths is not None:
        out["paths"] = c.paths.to_json()
    if c.step_ratios is not None:
        out["step_ratios"] = c.step_ratios
    scale = c.speed_scale
    out["speed_scale"] = None if scale is None else scale.prefill
    out["decode_speed_scale"] = None if scale is None else scale.decode
    out["speed_split"] = scale is not None and scale.split
    if (t := c.speed_timeline) is not None:
        out["speed_timeline"] = {"window_s": t.window_s, "prompt": list(t.prompt),
                                 "decode": list(t.decode), "prompt_run": t.prompt_run,
                                 "decode_run": t.decode_run}
    return out
