"""Synthetic measurements shaped like pdserve's: worker step traces (`bench compare`'s
.steps.json) and bench serve/compare results, from a known linear machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

D0, D1 = 0.020, 0.002  # decode overhead, per-seq seconds
C1 = 0.00001  # decode per-context-token seconds
P0, P1 = 0.010, 0.0002  # prefill overhead, per-token seconds
PA = 2e-8  # prefill per attention pair seconds
BATCHES = (1, 2, 3, 5, 8)
CONTEXTS = (100, 400, 1600)  # context per sequence
TOKENS = (100, 400, 1600, 6000)


def decode_steps(d0: float = D0, d1: float = D1, repeat: int = 5, gap: float = 0.0,
                 slow: int | None = None, t0: float = 1000.0) -> list[list[float]]:
    """Decode-only steps at every B in BATCHES, `repeat` rounds, `gap` s apart; in round
    `slow` every step takes 20 times as long (a descheduled process)."""
    rows, t = [], t0
    for r in range(repeat):
        for b in BATCHES:
            d = (d0 + d1 * b) * (20 if r == slow else 1)
            rows.append([t, t + d, 0, b, b])
            t += d + gap
    return rows


def context_decode_steps(d0: float = D0, d1: float = D1, c1: float = C1, repeat: int = 5,
                         contexts: tuple[int, ...] = CONTEXTS, spread: int = 0,
                         t0: float = 1000.0, knee: int = 0, dk: float = 0.0,
                         batches: tuple[int, ...] = BATCHES) -> list[list[float]]:
    """6-field decode-only steps, t = d0 + d1 B + dk max(0, B - knee) + c1 C, at every B in
    `batches` and context per sequence in `contexts` (C = B x (context + spread x round):
    `spread` tokens more per round, within one quarter-octave group), `repeat` rounds back to
    back."""
    rows, t = [], t0
    for r in range(repeat):
        for b in batches:
            for ctx in contexts:
                c = b * (ctx + spread * r)
                d = d0 + d1 * b + dk * max(0, b - knee) + c1 * c
                rows.append([t, t + d, 0, b, b, c])
                t += d
    return rows


def prefill_steps(p0: float = P0, p1: float = P1, repeat: int = 3, slow: int | None = None,
                  t0: float = 1000.0) -> list[list[float]]:
    """Pure prefill steps of every N in TOKENS, idle for a second after each."""
    rows, t = [], t0
    for r in range(repeat):
        for n in TOKENS:
            d = (p0 + p1 * n) * (20 if r == slow else 1)
            rows.append([t, t + d, n, 0, 1])
            t += d + 1.0
    return rows


def attention_prefill_steps(p0: float = P0, p1: float = P1, pa: float = PA,
                            repeat: int = 3) -> list[list[float]]:
    """7-field pure prefill steps, t = p0 + p1 N + pa A: whole prompts of every N in TOKENS,
    and chunks of 400 tokens after 1,200 and 4,000 cached ones; idle for a second after each."""
    rows, t = [], 1000.0
    shapes = [(n, 0) for n in TOKENS] + [(400, 1200), (400, 4000)]
    for _ in range(repeat):
        for n, start in shapes:
            a = n * start + n * (n + 1) // 2
            d = p0 + p1 * n + pa * a
            rows.append([t, t + d, n, 0, 1, 0, a])
            t += d + 1.0
    return rows


def disagg_workers(**kw: Any) -> dict[str, list[list[float]]]:
    return {"prefill-0": prefill_steps(), "decode-0": decode_steps(**kw)}


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


def request(start_s: float, prompt: int, output: int, ok: bool = True,
            ttft_s: float = 0.1) -> dict[str, Any]:
    """One request as `bench serve` writes it (of its timings the simulator reads the TTFT,
    to fit a calibration run's front-end round trip)."""
    return {"start_s": start_s, "ttft_s": ttft_s if ok else None, "itl_s": [], "e2e_s": 1.0,
            "tpot_s": None, "output_tokens": output, "prompt_tokens": prompt, "ok": ok,
            "error": None if ok else "HTTP 500: boom"}


def serve_result(requests: list[dict[str, Any]], ttft_ms: float | None = 100.0,
                 itl_ms: float | None = 20.0) -> dict[str, Any]:
    return {"completed": sum(r.get("ok", True) for r in requests), "median_ttft_ms": ttft_ms,
            "median_itl_ms": itl_ms, "p99_itl_ms": 99.0, "requests": requests}
