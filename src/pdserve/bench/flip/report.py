"""The summary of one `pdserve bench flip` run: one JSON object, and its readable form.

Counts are over the load's requests (the reference pass is not counted): requests = ok +
failed, failed being every request that did not end ok (`chaos.stream.Outcome`: an error
status or event, a broken or a hung stream). `mismatches` counts the ok requests whose text
differs from their prompt's reference (`mismatches_away_from_flips` those of them not in
flight at any flip); `requests_across_flips` the requests in flight when a flip the router did
was commanded (sent before it, ended after it). Flip seconds (median,
worst) are over the flips the router did (`done`), from its replies. `leaked_blocks` sums the
KV blocks the workers still held once idle (a worker that did not answer is in
`workers_unreachable`).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from pdserve.bench.chaos.report import MAX_ERRORS
from pdserve.bench.flip.cli import GOAL_MEDIAN_S, GOAL_WORST_S
from pdserve.bench.flip.flips import DONE, FAILED, REFUSED, FlipRecord
from pdserve.bench.flip.load import Served


def _across(r: Served, flips: Sequence[FlipRecord]) -> list[int]:
    """The flips done that were commanded while `r` was in flight."""
    return [f.n for f in flips if f.status == DONE and r.start_s < f.at_s < r.end_s]


def first_mismatch(results: Sequence[Served], reference: Sequence[str],
                   flips: Sequence[FlipRecord]) -> tuple[int, dict[str, Any] | None]:
    """(how many ok requests differ from their reference, the first of them by end time, with
    the flips it was in flight at)."""
    wrong = sorted((r for r in results if r.ok and r.text != reference[r.prompt]),
                   key=lambda r: r.end_s)
    if not wrong:
        return 0, None
    r, ref = wrong[0], reference[wrong[0].prompt]
    at = next((i for i, (a, b) in enumerate(zip(ref, r.text, strict=False)) if a != b),
              min(len(ref), len(r.text)))
    return len(wrong), {"prompt": r.prompt, "id": r.response_id, "start_s": round(r.start_s, 3),
                        "end_s": round(r.end_s, 3), "in_flight_at_flips": _across(r, flips),
                        "first_diff_char": at, "expected": ref, "got": r.text}


def _goal(values: list[float], bound: float, pick: str) -> dict[str, Any]:
    value = (statistics.median(values) if pick == "median" else max(values)) if values \
        else None
    return {"seconds": value, "under_s": bound,
            "pass": None if value is None else value < bound}


def summarize(results: Sequence[Served], reference: Sequence[str],
              flips: Sequence[FlipRecord], moved: dict[str, int],
              blocks: dict[str, int | None], settings: dict[str, Any]) -> dict[str, Any]:
    """The run's JSON object (see the module docstring); `moved`: the router's streams
    continued on another worker during the load, by reason."""
    done = [f.seconds for f in flips if f.status == DONE and f.seconds is not None]
    firsts = [f.first_step_s for f in flips if f.first_step_s is not None]
    mismatches, first = first_mismatch(results, reference, flips)
    ok = sum(r.ok for r in results)
    return {
        "flips_done": len(done),
        "flips_refused": sum(f.status == REFUSED for f in flips),
        "flips_failed": sum(f.status == FAILED for f in flips),
        "median_flip_s": statistics.median(done) if done else None,
        "worst_flip_s": max(done) if done else None,
        "first_step_observed": len(firsts),
        "median_first_step_s": statistics.median(firsts) if firsts else None,
        "worst_first_step_s": max(firsts) if firsts else None,
        "goals": {"median_flip": _goal(done, GOAL_MEDIAN_S, "median"),
                  "worst_flip": _goal(done, GOAL_WORST_S, "worst")},
        "requests": len(results), "ok": ok, "failed": len(results) - ok,
        "requests_across_flips": sum(bool(_across(r, flips)) for r in results),
        "streams_moved": moved,
        "errors": [{"count": n, "outcome": o, "detail": d} for (o, d), n in Counter(
            (r.outcome.value, r.detail) for r in results if not r.ok).most_common(MAX_ERRORS)],
        "mismatches": mismatches, "first_mismatch": first,
        "mismatches_away_from_flips": sum(r.ok and r.text != reference[r.prompt]
                                          and not _across(r, flips) for r in results),
        "leaked_blocks": sum(v for v in blocks.values() if v is not None),
        "blocks_by_worker": blocks,
        "workers_unreachable": [name for name, v in blocks.items() if v is None],
        "flips": [f.to_json() for f in flips],
        "settings": settings,
    }


def correct(report: dict[str, Any]) -> bool:
    """No failed request or flip, every output as the reference, no leaked block, every worker
    answering. The timing goals do not count here."""
    return (report["failed"] == 0 and report["flips_failed"] == 0 and report["mismatches"] == 0
            and report["leaked_blocks"] == 0 and not report["workers_unreachable"])


def progress_line(f: FlipRecord, total: int, results: Sequence[Served]) -> str:
    """One flip, and the requests so far."""
    ok = sum(r.ok for r in results)
    head = f"flip {f.n}/{total}: {f.worker} {f.from_role} -> {f.to_role}"
    if f.status != DONE:
        return f"{head}: {f.status.upper()} after {f.call_s:.3f} s: {f.error}"
    first = "not seen in the pause" if f.first_step_s is None else \
        f"after {f.first_step_s:.3f} s"
    return (f"{head} in {f.seconds:.3f} s (reply; call {f.call_s:.3f} s), first step in the "
            f"new role {first}; requests so far {ok} ok, {len(results) - ok} failed")


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"


def _goal_line(name: str, goal: dict[str, Any]) -> str:
    verdict = {True: "PASS", False: "FAIL", None: "N/A"}[goal["pass"]]
    return f"goal {name} flip < {goal['under_s']:g} s: {verdict} ({_seconds(goal['seconds'])})"


def format_summary(r: dict[str, Any]) -> str:
    lines = [f"flips: {r['flips_done']} done, {r['flips_refused']} refused, "
             f"{r['flips_failed']} failed; reply seconds median "
             f"{_seconds(r['median_flip_s'])}, worst {_seconds(r['worst_flip_s'])}",
             f"first step in the new role seen after {r['first_step_observed']} flips: median "
             f"{_seconds(r['median_first_step_s'])}, worst {_seconds(r['worst_first_step_s'])}",
             _goal_line("median", r["goals"]["median_flip"]),
             _goal_line("worst", r["goals"]["worst_flip"]),
             f"requests: {r['requests']} total, {r['ok']} ok, {r['failed']} failed; "
             f"{r['requests_across_flips']} were in flight at a flip",
             f"streams the router continued on another worker, by reason: "
             f"{r['streams_moved'] or 'none'}",
             f"outputs differing from the reference: {r['mismatches']} "
             f"({r['mismatches_away_from_flips']} of requests not in flight at a flip)",
             f"KV blocks held once idle: {r['leaked_blocks']} {r['blocks_by_worker']}"]
    if r["first_mismatch"] is not None:
        m = r["first_mismatch"]
        lines.append(f"first mismatch: {m['id']}, prompt {m['prompt']}, {m['start_s']}-"
                     f"{m['end_s']} s (in flight at flips {m['in_flight_at_flips']}), from "
                     f"character {m['first_diff_char']}: expected {m['expected']!r}, got "
                     f"{m['got']!r}")
    lines += [f"refused or failed flip {f['n']}: {f['error']}" for f in r["flips"]
              if f["status"] != DONE]
    if r["errors"]:
        lines.append("requests that did not end ok, by reason:")
        lines += [f"  {e['count']:4d} {e['outcome']}: {e['detail']}" for e in r["errors"]]
    lines.append("verdict: " + ("correct" if correct(r) else "NOT CORRECT"))
    return "\n".join(lines)
