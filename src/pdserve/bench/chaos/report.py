"""The summary of one `pdserve bench chaos` run: one JSON object, and its readable form.

Counts are over the load's requests only (the fault injections' own requests are in `faults`):
requests = ok + failed + broken + hung. Latencies are in ms: `p50_e2e_ms` / `p99_e2e_ms` over
the ok requests (send to `[DONE]`); `max_error_latency_ms` over the failed ones, each from the
later of its send and the last fault injected before its error, to the error (None without a
failed request). `leaked_blocks` is the sum of the KV blocks the workers still held once the
cluster settled (a worker that did not answer counts in `workers_unreachable`, not in the sum).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from pdserve.bench.chaos.faults import FaultRecord
from pdserve.bench.chaos.load import RequestResult
from pdserve.bench.chaos.stream import Outcome
from pdserve.bench.serve.metrics import percentile

MAX_ERRORS = 10
TIMELINE_S = 10.0


def error_latency_s(r: RequestResult, faults: Sequence[FaultRecord]) -> float:
    """From the later of the request's send and the last fault injected before it ended, to
    its end."""
    hits = [f.at_s for f in faults if f.injected and f.at_s <= r.end_s]
    return r.end_s - max([r.start_s, *hits])


def _ms(values: list[float], p: float) -> float | None:
    return round(1e3 * percentile(values, p), 1) if values else None


def summarize(results: Sequence[RequestResult], faults: Sequence[FaultRecord],
              blocks: dict[str, int | None], served_after: str,
              settings: dict[str, Any]) -> dict[str, Any]:
    """The run's JSON object (see the module docstring)."""
    counts = Counter(r.outcome for r in results)
    e2e = [r.end_s - r.start_s for r in results if r.outcome is Outcome.OK]
    failed = [r for r in results if r.outcome is Outcome.FAILED]
    injected = [f for f in faults if f.injected]
    total = len(results)
    return {
        "requests": total,
        "ok": counts[Outcome.OK], "failed": counts[Outcome.FAILED],
        "broken": counts[Outcome.BROKEN], "hung": counts[Outcome.HUNG],
        "failed_pct": round(100 * counts[Outcome.FAILED] / total, 2) if total else None,
        "not_ok_pct": round(100 * (total - counts[Outcome.OK]) / total, 2) if total else None,
        "leaked_blocks": sum(v for v in blocks.values() if v is not None),
        "blocks_by_worker": blocks,
        "workers_unreachable": [name for name, v in blocks.items() if v is None],
        "faults_injected": len(injected),
        "fault_kinds_injected": len({f.kind for f in injected}),
        "faults_not_as_promised": sum(not f.promised for f in faults),
        "p50_e2e_ms": _ms(e2e, 50), "p99_e2e_ms": _ms(e2e, 99),
        "max_error_latency_ms": round(1e3 * max(error_latency_s(r, faults) for r in failed), 1)
        if failed else None,
        "by_shape": _by_shape(results),
        "timeline": timeline(results),
        "errors": [{"count": n, "outcome": o, "detail": d} for (o, d), n in Counter(
            (r.outcome.value, r.detail) for r in results if r.outcome is not Outcome.OK
        ).most_common(MAX_ERRORS)],
        "served_after": served_after,
        "faults": [f.to_json() for f in sorted(faults, key=lambda f: f.at_s)],
        "settings": settings,
    }


def _by_shape(results: Sequence[RequestResult]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in results:
        row = out.setdefault(r.shape, {o.value: 0 for o in Outcome})
        row[r.outcome.value] += 1
    return out


def timeline(results: Sequence[RequestResult], step_s: float = TIMELINE_S
             ) -> list[dict[str, float | int]]:
    """The outcomes by when the requests ended, in `step_s` buckets from the load's start
    (every bucket up to the last request's, empty ones too)."""
    if not results:
        return []
    rows = [{"t_s": i * step_s} | {o.value: 0 for o in Outcome}
            for i in range(int(max(r.end_s for r in results) // step_s) + 1)]
    for r in results:
        rows[int(r.end_s // step_s)][r.outcome.value] += 1
    return rows


def healthy(report: dict[str, Any]) -> bool:
    """No hung request, no leaked block, every worker answering, every fault as promised, and
    the cluster served a request after the run."""
    return (report["hung"] == 0 and report["leaked_blocks"] == 0
            and not report["workers_unreachable"] and report["faults_not_as_promised"] == 0
            and report["served_after"] == "ok")


def format_summary(r: dict[str, Any]) -> str:
    lines = [f"{r['requests']} requests: {r['ok']} ok, {r['failed']} failed (clean errors, "
             f"{r['failed_pct']}%), {r['broken']} broken, {r['hung']} hung",
             f"e2e of ok requests: P50 {r['p50_e2e_ms']} ms, P99 {r['p99_e2e_ms']} ms; "
             f"slowest clean error after its fault: {r['max_error_latency_ms']} ms",
             f"KV blocks held once idle: {r['leaked_blocks']} {r['blocks_by_worker']}; served "
             f"after the run: {r['served_after']}",
             f"{r['faults_injected']} faults injected ({r['fault_kinds_injected']} kinds), "
             f"{r['faults_not_as_promised']} not as promised:"]
    for f in r["faults"]:
        mark = "" if f["promised"] else "  <-- NOT AS PROMISED"
        done = "" if f["injected"] else " (not injected)"
        lines.append(f"  {f['at_s']:7.1f} s  {f['kind']:<21} {f['target']}{done}: "
                     f"{f['outcome']}{mark}")
    if r["errors"]:
        lines.append("requests that did not end ok, by reason:")
        lines += [f"  {e['count']:4d} {e['outcome']}: {e['detail']}" for e in r["errors"]]
    return "\n".join(lines)
