"""What each worker's engine did during a measured run, from its step trace: where a layout's
throughput went (a decode step's cost per stream on the worker's share of the cores, the time
its prompts took) when two layouts of the same cores differ.

Per worker, over the steps that started within the run [start, end] (wall clock, as
`GET /internal/steps` records them, rows [start, end, prefill_tokens, decode_tokens, ...]):

- busy_s: the steps' summed durations;
- decode_steps, decode_batch, decode_step_ms: the decode-only steps, their mean batch (decode
  tokens) and median duration; stream_ms = decode_step_ms / decode_batch, what one stream's
  token cost there (below 1 stream: no such steps, all three 0);
- prompt_steps, prompt_tokens, prompt_s: the steps that computed prompt tokens (with or without
  decodes beside them), their tokens and summed durations;
- paced_steps, paced_ms, paced_p99_ms: those of them that also decoded (a chunk beside
  streams, paced to the TPOT target where the worker has one), their median and 99th
  percentile durations (nearest rank; 0 with none): the inter-token latency a prompt cost the
  streams.

`bench compare` keeps it per worker in its results (`workers[NAME]["steps"]`) and prints a line
per worker under the table.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any


def summarize(rows: Sequence[Sequence[float]], start: float, end: float) -> dict[str, Any]:
    """The module docstring's figures for one worker's step rows."""
    rows = [r for r in rows if start <= r[0] <= end]
    decode = [r for r in rows if not r[2] and r[3]]
    prompt = [r for r in rows if r[2]]
    batch = statistics.fmean(r[3] for r in decode) if decode else 0.0
    step_ms = statistics.median((r[1] - r[0]) * 1e3 for r in decode) if decode else 0.0
    paced = sorted((r[1] - r[0]) * 1e3 for r in prompt if r[3])
    return {"busy_s": sum(r[1] - r[0] for r in rows), "decode_steps": len(decode),
            "decode_batch": batch, "decode_step_ms": step_ms,
            "stream_ms": step_ms / batch if batch else 0.0,
            "prompt_steps": len(prompt), "prompt_tokens": int(sum(r[2] for r in prompt)),
            "prompt_s": sum(r[1] - r[0] for r in prompt),
            "paced_steps": len(paced), "paced_ms": statistics.median(paced) if paced else 0.0,
            "paced_p99_ms": paced[math.ceil(0.99 * len(paced)) - 1] if paced else 0.0}


def format_summary(s: Mapping[str, Any], run_s: float) -> str:
    """"busy 57.0 of 63.5 s; 1,097 decode-only steps (batch 7.6, median 36.6 ms, 4.82 ms a
    stream); 153 prompt steps (18,215 tokens, 14.4 s, 140 beside streams (median 96 ms, P99
    118 ms))"; a summary from before the paced figures has none."""
    decode = (f"{_steps(s['decode_steps'], 'decode-only')} (batch {s['decode_batch']:.1f}, "
              f"median {s['decode_step_ms']:.1f} ms, {s['stream_ms']:.2f} ms a stream)"
              if s["decode_steps"] else "no decode-only step")
    paced = (f", {s['paced_steps']:,} beside streams (median {s['paced_ms']:.0f} ms, P99 "
             f"{s['paced_p99_ms']:.0f} ms)" if s.get("paced_steps") else "")
    return (f"busy {s['busy_s']:.1f} of {run_s:.1f} s; {decode}; "
            f"{_steps(s['prompt_steps'], 'prompt')} ({s['prompt_tokens']:,} tokens, "
            f"{s['prompt_s']:.1f} s{paced})")


def _steps(n: int, kind: str) -> str:
    return f"{n:,} {kind} step{'' if n == 1 else 's'}"
