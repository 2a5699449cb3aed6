"""The prompt tokens a worker computes per step while streams decode on it, so that their
inter-token times stay within the targets (`pdserve worker --slo-tpot-ms`, `--slo-itl-ms`): a
decode worker's local prefills (conditional disaggregation chose them, `router/split_decision.py`)
run in chunks beside its streams instead of freezing them for a whole prompt.

    C = max(block_size, largest N with  s(D) + beta N + gamma (N p + N (N + 1) / 2) <= a)

s(D) = s0 + e D: the decode part of a step beside D streams, fitted to the last `WINDOW`
decode-only steps (`common/step_cost.py`; their median where the batch never changed), D the
streams the next step decodes; p: the prompt tokens already computed (or cached) before the
chunk, so N p + N (N + 1) / 2 are the (query, key) pairs its N tokens attend to. beta, gamma: a
prompt step's own cost, per token and per attended pair, fitted to the last `WINDOW` steps that
computed N > 0 prompt tokens in t seconds, less s(D) for a step that also decoded D streams;
gamma = 0 and beta = 1 / R where the steps cannot tell the two apart, R a flat marginal rate,
and a chunk attending to more than its steps did is priced at their widest span (a fit on short
prompts is not stretched over a long one).

A flat rate would size every chunk of a long prompt alike, its early chunks (little to attend
to) ending under the allowance and its late ones over it: on a CPU core a 375-token chunk of
SmolLM2 after 1,125 tokens of context costs about 1.4x one at the start (fitted by
`tools/pacing/chunk_cost.py` from a served run's steps). And a median decode step would price
a step beside 6 streams at what one stream costs, the most common batch between prompts (on
the same machine 11 ms against 30). At least one block per step, so a prompt always progresses
(its streams then see up to s(D) + one block's cost).

    a = min(L, TPOT + max(0, B))     B_k = clamp(B_(k-1) + TPOT - d_k, -B_max, B_max)
    B_max = BURST_STEPS x (L - TPOT)

L: the ITL ceiling (`--slo-itl-ms`, default the TPOT target: then a = TPOT, B_max = 0, and every
step keeps within the target). B: credit, a token bucket (as in traffic shaping) over the gaps
between the streams' tokens: each step that decoded, lasting d_k, adds what it left of the TPOT
target (negative past it); B starts at 0. The TPOT target bounds a stream's *mean* time per
output token (what the goodput SLO measures), L each gap. While every step keeps within its
allowance B stays >= 0, and summing the bucket's steps, any k consecutive gaps last at most k x
TPOT + B_max (credit capped away only lowers the sum): a stream of k tokens averages at most
TPOT + B_max / k (with L 300 ms and TPOT 100 ms: 117 ms over 96 tokens at worst, after a full
bucket of bursts inside its life) and waits at most L for any token. A step that overruns its
allowance (the chunk is an estimate) leaves a debt that holds the steps at TPOT until cheap
steps repay it (forgotten beyond B_max). Cheap decode-only steps earn the credit that larger
chunks spend: a prompt that arrives while the streams run ahead of their target prefills in a
few long steps instead of many short ones, each of which carries the streams' decode work too
(on a CPU that work is not hidden under the prompt's: every extra step adds s to the prompt's
time to first token). Under a sustained prompt load the bucket empties and the steps come back
to TPOT: the mean holds.

With a TTFT target (`--slo-ttft-ms`) the steps also run to L, whatever the credit, while a
prompt here would miss its first token at the pace a sets:

    a = L   while  max_k (w_k + ceil(Q_k / C) a) > TTFT

over the prompts k not yet computed here, oldest first: w_k how long prompt k has waited, Q_k
the prompt tokens left up to and including its own, C the chunk at a. The bucket keeps
counting, so the steps come back to the credit's pace once the prompts are on time. It trades
the streams' mean time per token (each gap still within L) for the prompts' first tokens: at
the credit's pace a burst of prompts drains at a - s(D) of prompt work a step, and a queue
that keeps growing past its prompts' target fails every one of them, where a stream's mean can
recover over its remaining tokens.

Until s(D) is measured (no stream decoded here yet) there is nothing to protect: no cap. Until
a prompt step is timed, one block. With s (the median decode step) at or over the target no
chunk keeps a step within it: the streams already miss it, a step beside them still carries one
block, and a local prompt advances a block a step; the worker says so in its log
(`past_target`), since only its operator can change it (a larger target, fewer streams per
worker, more decode workers).

`C` is reported in the signed /health as `chunk_tokens`, the stall the router's decision
counts for one step of this worker.

When the worker's cores change while it serves (`workers/cpu_pin.py`: an elastic pair lends
or takes back a core), its steps before the change were timed on another number of threads.
Where it lost threads (T_before > T_now) each such step is priced as if it took T_before / T_now
times as long, until steps on the new cores push it out of the window: prompt work is
compute-bound and scales with the cores, decode work bound by memory scales less, so the factor
errs long and the chunks short. Where it gained threads they are kept as timed (slower than
the new cores: the chunks err short again). Unscaled, a worker that lost one core of two paced
its chunks at the two cores' cost, and its steps beside streams took 500-700 ms against a 300
ms ceiling until the window turned over (a measured mixed run, docs/benchmarks.md).

Lifetime: s(D), beta and gamma are read from the step trace every `REFRESH_S` on the engine
thread (`EngineLoop`); B follows every step, and a and C are recomputed after it for the next,
at its streams D and the context p of the prompt it computes first (`Engine.chunk_site`,
`Engine.set_prefill_chunk`).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence

from pdserve.common.step_cost import (
    DecodeCost,
    PromptCost,
    fit_decode_cost,
    fit_prompt_cost,
    misses_ttft,
)
from pdserve.workers.step_rates import SCAN, WINDOW
from pdserve.workers.step_trace import Step, StepTrace

REFRESH_S = 0.5  # a few decode steps: follows a changing batch, costs nothing measurable
BURST_STEPS = 8  # steps at the ceiling one full bucket pays for: a long prompt's chunks and more
MAX_CHANGES = 8  # core changes remembered: older ones are out of any window by then


def marginal_prefill_rate(newest_first: list[Step], decode_step_s: float | None,
                          window: int = WINDOW) -> float | None:
    """R above; None before any step computed prompt tokens in measurable time."""
    tokens, seconds, counted = 0, 0.0, 0
    for step in newest_first:
        if not step.prefill_tokens:
            continue
        decode_part = (decode_step_s or 0.0) if step.decode_tokens else 0.0
        prompt_part = step.end - step.start - decode_part
        if prompt_part > 0:
            tokens, seconds, counted = tokens + step.prefill_tokens, seconds + prompt_part, \
                counted + 1
        if counted >= window:
            break
    return tokens / seconds if seconds > 0 else None


def decode_steps(newest_first: Iterable[Step], window: int = WINDOW) -> list[tuple[int, float]]:
    """(D, t) of the last `window` decode-only steps of measurable length: those `step_rates`
    takes its median decode step from."""
    return list(itertools.islice(
        ((step.decode_tokens, step.end - step.start) for step in newest_first
         if step.decode_tokens and not step.prefill_tokens and step.end > step.start), window))


def prompt_cost(newest_first: list[Step], decode: DecodeCost | None,
                window: int = WINDOW) -> PromptCost | None:
    """beta and gamma above from the last `window` prompt steps; None before any was timed."""
    rows = []  # (N, P, t - s(D)) of each prompt step with a positive own part
    for step in newest_first:
        if not step.prefill_tokens:
            continue
        part = step.end - step.start - (decode.at(step.decode_tokens) if decode else 0.0)
        if part > 0:
            rows.append((step.prefill_tokens, step.prefill_attention, part))
            if len(rows) >= window:
                break
    return fit_prompt_cost(rows)


def past_target(tpot_target_s: float, decode_step_s: float | None) -> float | None:
    """The median decode-only step s when it is at or over the target (no chunk can keep a
    step within it: C is one block), else None (also while none was measured)."""
    return decode_step_s if decode_step_s is not None and decode_step_s >= tpot_target_s \
        else None


def step_allowance(tpot_target_s: float, itl_target_s: float, credit_s: float) -> float:
    """a above, from the bucket's credit B."""
    return min(itl_target_s, tpot_target_s + max(0.0, credit_s))


def chunk_tokens(allowance_s: float, decode_s: float | None, cost: PromptCost | None,
                 block_size: int, context: int = 0) -> int | None:
    """C above from a, the decode part s(D), the prompt cost and the context p: None (no cap)
    while no decode step was timed, a block while no prompt step was."""
    if decode_s is None:
        return None
    if cost is None:
        return block_size
    return max(block_size, cost.chunk(allowance_s - decode_s, context))


class Pacer:
    """A worker's chunk C after each step (module docstring): s(D) and the prompt cost read
    from its step trace every `REFRESH_S`, the credit B from each step it is shown.

    Lifetime: one per engine loop, used on its engine thread only; `past` is the median decode
    step when the last refresh found it at or over the TPOT target with C down to one block
    (the loop's warning), else None."""

    def __init__(self, tpot_target_s: float, itl_target_s: float | None,
                 block_size: int, ttft_target_s: float | None = None) -> None:
        self.tpot_target_s = tpot_target_s
        self.ttft_target_s = ttft_target_s
        self.itl_target_s = tpot_target_s if itl_target_s is None else itl_target_s
        self.burst_s = BURST_STEPS * (self.itl_target_s - tpot_target_s)  # B_max
        self.credit_s = 0.0  # B
        self._block = block_size
        self._read_at = -math.inf
        self._decode: DecodeCost | None = None
        self._cost: PromptCost | None = None
        self.past: float | None = None
        # (wall-clock start, compute threads) of each core change, oldest first; the first
        # entry (-inf, T) holds the threads before the first change; empty: never changed
        self._threads: list[tuple[float, int]] = []

    def cores_changed(self, at: float, threads_before: int, threads_now: int) -> None:
        """The engine computes on `threads_now` threads from wall-clock time `at` on (module
        docstring); the next chunk reads the steps again, priced for them."""
        if threads_now == threads_before:
            return
        if not self._threads:
            self._threads.append((-math.inf, threads_before))
        self._threads = [*self._threads[-(MAX_CHANGES - 1):], (at, threads_now)]
        self._read_at = -math.inf

    def _priced(self, step: Step) -> Step:
        """`step` as long as it would take on the current threads, where it ran on more
        (after a core change: `_threads` not empty)."""
        now = self._threads[-1][1]
        then = next((t for at, t in reversed(self._threads) if at <= step.start),
                    self._threads[0][1])
        if then <= now:
            return step
        return step._replace(end=step.start + (step.end - step.start) * then / now)

    def observe(self, step: Step) -> None:
        """A step the engine ran: a gap for the streams if it decoded."""
        if step.decode_tokens:
            gap = step.end - step.start
            credit = self.credit_s + self.tpot_target_s - gap
            self.credit_s = min(self.burst_s, max(-self.burst_s, credit))

    def chunk(self, trace: StepTrace, now: float, streams: int = 1, context: int = 0,
              queue: Sequence[tuple[float, int]] = ()) -> int | None:
        """C for the next step, which decodes `streams` streams (at least one: a chunk only
        caps a step beside streams), whose first prompt tokens come after `context` computed
        ones, with the prompts of `queue` (`Engine.prompt_queue`) waiting for their first token."""
        if now >= self._read_at + REFRESH_S:
            self._read_at = now
            steps = trace.newest_first(SCAN)
            if self._threads:
                steps = [self._priced(step) for step in steps]
            decodes = decode_steps(steps)
            self._decode = fit_decode_cost(decodes)
            self._cost = None if self._decode is None else prompt_cost(steps, self._decode)
            median = statistics.median(t for _, t in decodes) if decodes else None
            self.past = past_target(self.tpot_target_s, median)
        allowance = step_allowance(self.tpot_target_s, self.itl_target_s, self.credit_s)
        decode_s = None if self._decode is None else self._decode.at(max(1, streams))
        chunk = chunk_tokens(allowance, decode_s, self._cost, self._block, context)
        if chunk is None or self.ttft_target_s is None or allowance >= self.itl_target_s or \
                not misses_ttft(queue, now, chunk, allowance, self.ttft_target_s):
            return chunk
        return chunk_tokens(self.itl_target_s, decode_s, self._cost, self._block, context)
