"""Measured serving runs as simulator input: the results JSON of `pdserve bench serve --out` or
`pdserve bench compare --out`, replayed as a trace and compared by its figures (METRICS).

Shapes, told apart by shape:
- a serve result: an object with "requests", a list of {start_s, prompt_tokens, output_tokens,
  ok, ...} (bench/serve/metrics.py request_json), beside vLLM's metric keys (median_ttft_ms,
  median_itl_ms, ...);
- a compare result: an object of configuration name -> serve result. FILE:CONFIG picks one; a
  file holding a single configuration needs no :CONFIG.

Trace: every request, ok or not (the server saw them all), as arrival_s = start_s (seconds
from the run's first send), prompt_tokens, output_tokens, and its shared prefix's prefix_id and
prefix_tokens where the row has them (the `prefix` workload; absent: none), sorted by arrival
(stable), with each request's path where pdserve's router told it (its `route`,
path_agreement.py). A request that failed before its first token reports output_tokens 0; it
is replayed as a one-token request (it still queued and most likely prefilled; the result
does not keep the max_tokens it asked for).
Warm-up: bench compare's `warm_up` requests (prompt_tokens, output_tokens), which served just
before the run, are kept apart (`MeasuredRun.warm_up`) for the simulation to serve first.
Measured figures cover the successful requests only (bench serve's metrics); a run with none
has None there, as has a result written before a figure was recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.common.numbers import is_finite_number
from pdserve.planner.simulate.file_spec import (
    FileSpec,
    parse_file_spec,
    parse_json_document,
    pick_config,
    read_text,
    refuse_config,
)
from pdserve.planner.simulate.path_agreement import route_is_local
from pdserve.planner.simulate.speed_scale import (
    SpeedReference,
    read_rounds_reference,
    read_steps_reference,
)
from pdserve.planner.simulate.trace import TraceRequest, json_row, read_trace_jsonl, request_at

# What a simulation is held to, by vLLM `bench serve` key (ms, requests/s, tokens/s).
METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "request_goodput",
           "output_throughput")


def is_serve_result(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("requests"), list)


def is_compare_result(data: Any) -> bool:
    return (isinstance(data, dict) and bool(data)
            and all(is_serve_result(v) for v in data.values()))


@dataclass(frozen=True)
class MeasuredRun:
    """One measured run: where it came from, its requests as a trace, its measured figures by
    vLLM key (METRICS), and how many requests succeeded and failed."""

    label: str
    config: str | None
    trace: tuple[TraceRequest, ...]
    measured: dict[str, float | None]
    completed: int
    failed: int
    # the goodput bounds the run counted with (its `slo_ttft_ms`, `slo_tpot_ms`), None: none
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # closed loop: the clients that sent the requests, each its next when its last ended (the
    # run's `max_concurrency`); None: open loop, the requests replayed at their send times
    clients: int | None = None
    # prompts the router kept on their decode worker during the run (bench compare's
    # split_decisions "local", a median over repeats); None: not recorded (a serve result, an
    # older file)
    local_prefills: float | None = None
    # the successful requests' TTFTs in seconds, in the file's order; empty for a file
    # without them
    ttfts_s: tuple[float, ...] = ()
    # bench compare's idle probes after the run (bench/frontend_probe.py): their prompt tokens
    # and TTFTs; None and () for a file without them
    probe_prompt_tokens: int | None = None
    probe_ttfts_s: tuple[float, ...] = ()
    # the probes' own engine steps in the workers' traces, seconds, in the probes' order; ()
    # for a file without them, or when they do not pair with the TTFTs one for one
    probe_steps_s: tuple[float, ...] = ()
    # bench compare's fixed engine job timed around the run (speed_scale.py); None: not timed.
    # With repeats: the rounds' whose steps the .steps.json holds (speed_scale.
    # read_steps_reference: every round's, or the last one's in older files), and
    # `rounds_reference` every round's pooled (the figures' rounds); else the two are the same
    speed_reference: SpeedReference | None = None
    rounds_reference: SpeedReference | None = None
    # each trace request's path as pdserve's router told it (its `route`,
    # path_agreement.route_is_local: True local, False split, None not told), in trace order;
    # () for a file without routes
    paths: tuple[bool | None, ...] = ()
    # bench compare's warm-up requests, served one after the other just before the run (their
    # arrival 0, no shared prefix); () for a file without them
    warm_up: tuple[TraceRequest, ...] = ()
    # the wall-clock time of the run's first send (bench compare's `run_window`), which the
    # workers' step traces count on; None: not recorded
    run_start_s: float | None = None
    # bench compare's rounds (`repeats`) the figures are medians of; 1: a single run
    rounds: int = 1
    # the ceiling the cluster paced its decode workers' steps to (bench compare's
    # `slo_itl_ms`, pdserve up --slo-itl-ms); None: none (steps within the TPOT target)
    slo_itl_ms: float | None = None
    # an elastic pair served merged the whole run (`served_merged`): its prefill worker's
    # cores lent to the decode worker before the first request and never taken back, no role
    # flipped, every prompt prefilled on the decode worker on both sets of cores
    merged: bool = False

    @property
    def probed(self) -> bool:
        """The run has idle probes to measure the front end by (bench/frontend_probe.py)."""
        return self.probe_prompt_tokens is not None and bool(self.probe_ttfts_s)

    def __post_init__(self) -> None:
        if not self.trace:
            raise ValueError(f"{self.label}: the run holds no requests")
        for key, value in self.measured.items():
            if value is not None and not (is_finite_number(value) and value >= 0):
                raise ValueError(f"{self.label}: {key} must be a finite number >= 0 or null, "
                                 f"got {value!r}")


def _select(data: Any, spec: FileSpec) -> tuple[str | None, dict[str, Any]]:
    """(configuration name or None, the serve result) that `spec` names."""
    if is_serve_result(data):
        refuse_config(spec, "a bench serve result")
        return None, data
    if spec.config is not None:
        return spec.config, pick_config(spec, data, "bench compare result")
    if len(data) != 1:
        raise ValueError(f"{spec.flag} {spec.path} holds configurations "
                         f"{', '.join(map(repr, data))}: choose one as {spec.path}:CONFIG")
    return next(iter(data.items()))


def _request(row: Any, where: str) -> TraceRequest:
    row = json_row(row, where, ("start_s", "prompt_tokens", "output_tokens"))
    out = row["output_tokens"]
    if out == 0 and not row.get("ok", True):
        out = 1  # failed before its first token: replayed as a one-token request
    return request_at(where, row["start_s"], row["prompt_tokens"], out, row.get("prefix_id"),
                      row.get("prefix_tokens", 0))


def _run(spec: FileSpec, config: str | None, result: dict[str, Any]) -> MeasuredRun:
    label = str(spec) if config is None or spec.config else f"{spec}:{config}"
    rows = result["requests"]
    requests = sorted(((_request(r, f"{label} request {i}"), route_is_local(r.get("route")))
                       for i, r in enumerate(rows, start=1)), key=lambda pair: pair[0].arrival_s)
    trace, paths = zip(*requests, strict=True) if requests else ((), ())
    ok = sum(1 for r in rows if r.get("ok", True))
    return MeasuredRun(label, config, tuple(trace),
                       {k: result.get(k) for k in METRICS}, ok, len(rows) - ok,
                       _bound(result, "slo_ttft_ms", label), _bound(result, "slo_tpot_ms", label),
                       _clients(result, label), _local_prefills(result, label),
                       _ttfts(rows), *_probe(result, label),
                       read_steps_reference(result, label), read_rounds_reference(result, label),
                       tuple(paths) if any(p is not None for p in paths) else (),
                       _warm_up(result, label), _run_start(result, label),
                       len(result["repeats"]) if isinstance(result.get("repeats"), list)
                       and result["repeats"] else 1,
                       slo_itl_ms=_bound(result, "slo_itl_ms", label),
                       merged=served_merged(result))


# what ends a merged run (`served_merged`), for the messages that say why one is not
NOT_MERGED = "a role flipped, the cores were taken back, or the prefill worker computed"


def served_merged(result: dict[str, Any]) -> bool:
    """The run's pair served merged throughout (bench compare's `workers`, `role_flips`,
    `core_loans`, `core_reclaims`, `split_decisions`): in every round one loan, never taken
    back, no flip and no prompt prefilled remotely, and every worker that started as a
    prefill worker computed no step (its `steps.busy_s` 0; the last round's, the only one
    whose workers a file keeps), so one engine on both sets of cores computed every step.
    False where the file does not record workers or their steps."""
    workers = result.get("workers")
    rounds = result.get("repeats") if isinstance(result.get("repeats"), list) else [result]
    if not isinstance(workers, dict) or not workers or not all(map(_lent_alone, rounds)):
        return False
    lenders = [w for w in workers.values() if _first_role(w) == "prefill"]
    return bool(lenders) and all(_busy_s(w) == 0 for w in lenders)


def _lent_alone(run: Any) -> bool:
    """A round with one loan, no reclaim (a file without the count: a second loan is one
    after a reclaim), no flip, and no remote prefill where its decisions are kept."""
    if not isinstance(run, dict) or run.get("role_flips") != 0:
        return False
    split = run.get("split_decisions")
    remote = split.get("remote", 0) if isinstance(split, dict) else 0
    return run.get("core_loans") == 1 and run.get("core_reclaims", 0) == 0 and remote == 0


def _first_role(worker: Any) -> str | None:
    roles = worker.get("roles") if isinstance(worker, dict) else None
    first = roles[0] if isinstance(roles, list) and roles else None
    return first.get("role") if isinstance(first, dict) else None


def _busy_s(worker: Any) -> float | None:
    """The seconds a bench compare worker computed steps in the run; None: not recorded."""
    steps = worker.get("steps") if isinstance(worker, dict) else None
    busy = steps.get("busy_s") if isinstance(steps, dict) else None
    return float(busy) if is_finite_number(busy) else None


def _run_start(result: dict[str, Any], label: str) -> float | None:
    """The start of the run's `run_window` [start, end] (wall-clock seconds); None without
    one."""
    window = result.get("run_window")
    if window is None:
        return None
    if not (isinstance(window, list) and len(window) == 2
            and all(is_finite_number(t) for t in window) and window[0] <= window[1]):
        raise ValueError(f"{label}: run_window must be [start, end] in seconds, got "
                         f"{str(window)[:80]}")
    return float(window[0])


def _warm_up(result: dict[str, Any], label: str) -> tuple[TraceRequest, ...]:
    """The run's `warm_up` requests (bench compare) as a trace; () without them."""
    rows = result.get("warm_up")
    if rows is None:
        return ()
    if not isinstance(rows, list):
        raise ValueError(f"{label}: warm_up must be a list of requests, got {str(rows)[:80]}")
    warm = []
    for i, row in enumerate(rows, start=1):
        where = f"{label} warm-up request {i}"
        row = json_row(row, where, ("prompt_tokens", "output_tokens"))
        warm.append(request_at(where, 0.0, row["prompt_tokens"], row["output_tokens"]))
    return tuple(warm)


def _probe(result: dict[str, Any], label: str
           ) -> tuple[int | None, tuple[float, ...], tuple[float, ...]]:
    """(prompt tokens, TTFTs, own steps' seconds) of the run's `frontend_probe`; (None, (),
    ()) without one; the steps () unless there is one per TTFT."""
    probe = result.get("frontend_probe")
    if probe is None:
        return None, (), ()
    tokens, ttfts = (probe.get("prompt_tokens"), probe.get("ttft_s")) \
        if isinstance(probe, dict) else (None, None)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1 or \
            not isinstance(ttfts, list) or not all(is_finite_number(t) and t >= 0 for t in ttfts):
        raise ValueError(f"{label}: frontend_probe must be {{\"prompt_tokens\": n >= 1, "
                         f"\"ttft_s\": [seconds >= 0, ...]}}, got {str(probe)[:80]}")
    steps = probe.get("step_s", [])
    if not isinstance(steps, list) or not all(is_finite_number(t) and t >= 0 for t in steps):
        raise ValueError(f"{label}: frontend_probe's step_s must be [seconds >= 0, ...], got "
                         f"{str(steps)[:80]}")
    paired = len(steps) == len(ttfts)
    return tokens, tuple(float(t) for t in ttfts), tuple(float(t) for t in steps) if paired \
        else ()


def _ttfts(rows: list[Any]) -> tuple[float, ...]:
    """The TTFTs (seconds) of the rows that succeeded and recorded one."""
    return tuple(float(t) for r in rows if isinstance(r, dict) and r.get("ok", True)
                 and is_finite_number(t := r.get("ttft_s")) and t >= 0)


def _bound(result: dict[str, Any], key: str, label: str) -> float | None:
    value = result.get(key)
    if value is not None and not (is_finite_number(value) and value > 0):
        raise ValueError(f"{label}: {key} must be a positive number of ms or null, "
                         f"got {value!r}")
    return value


def _local_prefills(result: dict[str, Any], label: str) -> float | None:
    counts = result.get("split_decisions")
    value = counts.get("local") if isinstance(counts, dict) else None
    if value is not None and not (is_finite_number(value) and value >= 0):
        raise ValueError(f"{label}: split_decisions local must be a count >= 0, got {value!r}")
    return value


def _clients(result: dict[str, Any], label: str) -> int | None:
    value = result.get("max_concurrency")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{label}: max_concurrency must be a positive integer or null, "
                         f"got {value!r}")
    return value


def load_measured_run(spec_text: str, flag: str) -> MeasuredRun:
    """The run RESULTS[:CONFIG] names; ValueError when the file is not a results file."""
    spec = parse_file_spec(spec_text, flag)
    data = parse_json_document(read_text(spec))
    if not (is_serve_result(data) or is_compare_result(data)):
        raise ValueError(f"{flag} {spec.path} is not a bench serve or compare results file "
                         '(an object with "requests", or of configurations that have them)')
    return _run(spec, *_select(data, spec))


def read_trace_file(spec_text: str) -> tuple[tuple[TraceRequest, ...], str]:
    """(trace, label) of --trace: a results file (its requests) or a JSONL trace (trace.py)."""
    flag = "trace (--trace)"
    spec = parse_file_spec(spec_text, flag)
    data = parse_json_document(read_text(spec))
    if is_serve_result(data) or is_compare_result(data):
        run = _run(spec, *_select(data, spec))
        return run.trace, f"requests of {run.label}"
    refuse_config(spec, "a JSONL trace")
    return read_trace_jsonl(spec.path), f"file {spec.path}"
