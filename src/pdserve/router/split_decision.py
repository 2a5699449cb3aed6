"""Conditional disaggregation from measured costs: prefill a prompt on a prefill worker and
move its KV, or prefill it where it will decode.

For a request of N prompt tokens, U_w of them uncached on worker w (the prefix w already holds
is not recomputed; the router's prefix index of what it sent each worker), with every rate
measured (`Speed`; workers report theirs in the signed /health, `workers/step_rates.py`; the
link is learnt here from the split requests' own hand-over times, per (prefill, decode) pair,
`link_estimates.py`, or for a pair with none in memory taken from the prefill worker's trusted
report of that link, `link_reports.py`), on the chosen decode worker d:

    t_remote = min over prefill workers p of (Q_p + U_p) / R_p  +  T_link(p, d)(N x b)
    t_local  = (Q_d + U_d) / R_d
    stall    = C / R_m          (the time one step of d's running streams gains; C / R_d where
                                 d reports no R_m)

U_p, not U_d, on the split path: the prefill worker computes what it lacks, whatever d holds
(a prompt whose prefix only d holds is a whole prompt's work there). N x b, not U_d x b, on the
link: the decode worker reserves blocks for every prompt token without its prefix cache and
the prefill worker sends every block of the prompt (`engine/scheduler.py` `reserve_remote`,
`workers/handover.py` `send_kv`), so the whole prompt's KV moves, in whole blocks (N is
rounded up to them by the caller, `PromptTokens.moved`).

Q_w: prompt tokens this router sent to w whose prefill has not ended (`PrefillBacklog`: the
router's own count, current, where a worker's report is a health interval old); R_p: p's
prefill rate, tokens/s (`rates.prefill_tokens_per_s`); b: KV bytes per token (2 x layers x KV
heads x head dim x dtype bytes, the paged layout `transfer/layout.py` moves); T_link(p, d)(bytes):
the hand-over time on the link from p to d (a slow link to one prefill host sends prompts to
another, or keeps them local when every link is slow); C = min(U_d, C_d), C_d d's prefill
chunk (`chunk_tokens`: its token budget per step with chunked prefill, or the chunk it paces;
U_d without). Both estimates are queueing plus service time: the time to first token each path
would give, apart from the common decode step.

R_d, the rate a prompt gets on d, is derived from d's marginal prefill rate R_m
(`rates.prefill_marginal_tokens_per_s`: sum N / sum (t - s) over its recent steps that computed
N prompt tokens in t seconds, its decode step s taken off only the steps that also decoded,
`workers/step_rates.py`) and what runs on d now. A step that carries C prompt tokens beside d's
streams takes s + C / R_m (the streams' decode step, then the prompt's own part), so

    R_d = R_m                    d has no leg open: the prompt runs alone, no decode part
    R_d = C / (s + C / R_m)      legs open: each step carries C prompt tokens and the
                                 streams' decode (without a chunk, C = U_d: one step for the
                                 whole prompt beside the streams)

s: d's `decode_step_s` (0 until measured); U_d counted as at least one token (a prompt the
cache holds whole still computes its last). A worker that reports no R_m (older, or no prompt
step timed yet) counts at its `prefill_tokens_per_s`: the average over its last prompt steps
counted whole, decode part included. That average keeps the streams that ran beside its last
local prompts, however long ago, and once prompts go remote it is never measured again, so a
low one sticks (an idle decode worker reported 39 tokens/s, left from 16-18-token chunks
beside 2-5 streams, where alone it prefills at ~67, and kept prompts remote that were faster
locally); R_m does not depend on those streams, so R_d counts the current ones instead.

The request runs locally when d can take it without breaking its streams' latency target and
local is no slower:

    local  <=>  (d has no leg open or d paces its chunks or decode_step_d + stall <= tpot_target)
                and t_local <= t_remote

Each decision's `reason` names the inputs of both estimates (U, Q, R, N and the link's
seconds, and how R_d was found), which the router's debug log of the request's path shows.

A worker started with `--slo-tpot-ms` (at most the router's) paces its chunks: it sizes them
from its own measured rates so that a step with streams stays within that target
(`workers/prefill_budget.py`, C_d = max(block, floor((TPOT - s) x R_m)); with `--slo-itl-ms`
up to that ceiling while its streams' credit lasts; reported as `chunk_tokens` and
`chunk_tpot_s`), so its stall needs no check here; its chunk sets the R_d above that t_local
counts.

(d's open legs are its streams and those about to start there, whose KV is on its way: a
local prefill stalls both). So a loaded prefill pool sends prompts to decode workers with
headroom, an idle cluster saves the transfer, a slow link keeps short prompts local, and a
decode worker never takes a whole prompt that would freeze its streams for longer than the
target (a chunked one takes it in bounded pieces). A worker that reports no rate counts at the
mean of the measured `prefill_tokens_per_s`; until none is measured there is no decision
(`None`): the caller uses the fixed `--local-prefill-threshold` rule, which also stays
available as an override.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.transfer.layout import DTYPE_BYTES, LAYOUT_PAGED_MLA

LinkTime = Callable[[int], float]  # KV bytes -> seconds to hand them over on one link


@dataclass(frozen=True)
class Speed:
    """One worker as the decision sees it."""

    prefill_tokens_per_s: float | None  # measured; None until it prefilled something
    decode_step_s: float | None = None  # measured decode-only step; None until it decoded
    backlog_tokens: int = 0  # Q: prompt tokens sent here whose prefill has not ended
    running: int = 0  # legs this router has open here: streams decoding, or about to
    chunk_tokens: int | None = None  # prefill tokens per step when chunked; None: whole prompts
    # the worker sizes its chunk itself so that a step stays within this (its --slo-tpot-ms,
    # `workers/prefill_budget.py`); None: a fixed chunk, or whole prompts
    paced_tpot_s: float | None = None
    # R_m: its prompt steps' tokens over their seconds less the decode part of mixed steps;
    # None: not reported (an older worker, or no prompt step timed yet)
    prefill_marginal_tokens_per_s: float | None = None

    @classmethod
    def of(cls, info: dict[str, Any], backlog_tokens: int, running: int) -> Speed:
        """From a worker's signed /health details (`rates`, `chunk_tokens`,
        `chunk_tpot_s`); a value that is no positive finite number counts as not reported."""
        rates = info.get("rates") or {}
        return cls(_positive(rates.get("prefill_tokens_per_s")),
                   _positive(rates.get("decode_step_s")), backlog_tokens, running,
                   _positive_int(info.get("chunk_tokens")), _positive(info.get("chunk_tpot_s")),
                   _positive(rates.get("prefill_marginal_tokens_per_s")))

    def step_tokens(self, uncached: int) -> int:
        """C: the prompt tokens one step computes of a prompt of `uncached` tokens here (at
        least one: a prompt the cache holds whole still computes its last)."""
        whole = max(uncached, 1)
        return min(whole, self.chunk_tokens or whole)


@dataclass(frozen=True)
class PromptTokens:
    """One prompt's token counts as the decision needs them (module docstring)."""

    moved: int  # N: tokens whose KV a split moves (every prompt token, in whole blocks)
    local: int  # U_d: those the decode worker lacks, computed there if local
    remote: tuple[int, ...]  # U_p: those each prefill worker given lacks, in order

    @classmethod
    def cold(cls, tokens: int, prefill_workers: int) -> PromptTokens:
        """A prompt no worker holds any of (`tokens` a whole number of blocks)."""
        return cls(tokens, tokens, (tokens,) * prefill_workers)


@dataclass(frozen=True)
class Decision:
    local: bool
    t_local_s: float
    t_remote_s: float
    prefill_index: int | None  # the prefill worker of t_remote (index into the list given)
    reason: str  # for the log: the rule and the inputs of both estimates
    # True: split because a local prefill would break the decode streams' TPOT target, whatever
    # the two times; False: the times decided
    over_tpot_target: bool = False
    t_remote_each_s: tuple[float, ...] = ()  # t_remote through each prefill worker given


def decide(prompt: PromptTokens, kv_bytes_per_token: int, decode: Speed, prefill: list[Speed],
           links: Sequence[LinkTime], tpot_target_s: float) -> Decision | None:
    """The path for `prompt` on `decode`; None while no rate is measured.
    `links[i]`: the hand-over time on the link from `prefill[i]` to `decode`.
    A worker not measured yet is taken to prefill as fast as the measured ones (the same
    model on the same kind of machine, as far as the router knows; their mean): else a prefill
    worker that never got a prompt would never be measured, and never get one."""
    known = [w.prefill_tokens_per_s for w in (decode, *prefill) if w.prefill_tokens_per_s]
    if not known:
        return None
    prior = sum(known) / len(known)
    nbytes = prompt.moved * kv_bytes_per_token
    each = tuple((p.backlog_tokens + u) / (p.prefill_tokens_per_s or prior) + link(nbytes)
                 for p, u, link in zip(prefill, prompt.remote, links, strict=True))
    t_remote, best = min((t, i) for i, t in enumerate(each))
    rate, how = local_rate(decode, prompt.local, prior)
    t_local = (decode.backlog_tokens + prompt.local) / rate
    inputs = _inputs(prompt, nbytes, decode, rate, how, prefill[best],
                     prefill[best].prefill_tokens_per_s or prior, best, links[best](nbytes))
    stall = min(prompt.local, decode.chunk_tokens or prompt.local) / \
        (decode.prefill_marginal_tokens_per_s or rate)
    step = decode.decode_step_s or 0.0
    paced = decode.paced_tpot_s is not None and decode.paced_tpot_s <= tpot_target_s
    if decode.running and not paced and step + stall > tpot_target_s:
        return Decision(False, t_local, t_remote, best,
                        f"a local prefill would make {decode.running} streams' steps "
                        f"{(step + stall) * 1e3:.0f} ms, over the {tpot_target_s * 1e3:.0f} ms "
                        f"target ({inputs})", over_tpot_target=True, t_remote_each_s=each)
    return Decision(t_local <= t_remote, t_local, t_remote, best,
                    f"first token in ~{t_local * 1e3:.0f} ms locally against "
                    f"~{t_remote * 1e3:.0f} ms split ({inputs})", t_remote_each_s=each)


def local_rate(decode: Speed, uncached: int, prior: float) -> tuple[float, str]:
    """R_d for a prompt of `uncached` tokens on `decode` (module docstring), and how it was
    found, for the reason. Positive: R_m, `prefill_tokens_per_s` and `prior` (the pool's mean
    of the latter) are."""
    r_m = decode.prefill_marginal_tokens_per_s
    if r_m is None:
        if decode.prefill_tokens_per_s:
            return decode.prefill_tokens_per_s, "its average, no R_m reported"
        return prior, "the pool's mean, no rate reported"
    if not decode.running:
        return r_m, "R_m, no leg open"
    c, s = decode.step_tokens(uncached), decode.decode_step_s or 0.0
    return c / (s + c / r_m), \
        f"C {c} / (s {s * 1e3:.0f} ms + C / R_m {r_m:.0f}/s), {decode.running} legs open"


def _inputs(prompt: PromptTokens, nbytes: int, decode: Speed, r_d: float, how: str,
            pre: Speed, r_p: float, index: int, link_s: float) -> str:
    """The inputs of both estimates, for the log: U, Q and R of each path (and how R_d was
    found), N and the link."""
    return (f"local: U_d {prompt.local} + Q_d {decode.backlog_tokens} tokens at "
            f"R_d {r_d:.0f}/s ({how}); split via prefill #{index}: "
            f"U_p {prompt.remote[index]} + "
            f"Q_p {pre.backlog_tokens} tokens at R_p {r_p:.0f}/s + {link_s * 1e3:.0f} ms to "
            f"move N {prompt.moved} tokens' KV ({nbytes / 1e6:.1f} MB)")


@dataclass(frozen=True)
class Sent:
    """Prompts, and their uncached tokens, a router sent to one worker to prefill."""

    prompts: int = 0
    tokens: int = 0


class PrefillBacklog:
    """Prompt tokens this router sent to each worker whose prefill has not ended (Q above):
    `add` when a leg that prefills goes out, the returned call when its first event or its end
    comes (calling it twice counts once). `sent` counts every request's prompt once, at the
    worker its first prefilling leg went to, since the router started, for arrival rates
    measured over time (the elastic controller's); a leg that restarts a request elsewhere
    (a retry, a hand-back) adds to the backlog but is no new arrival."""

    def __init__(self) -> None:
        self._tokens: dict[str, int] = {}
        self._sent: dict[str, Sent] = {}

    def tokens(self, worker: str) -> int:
        return self._tokens.get(worker, 0)

    def sent(self) -> dict[str, Sent]:
        """Per worker: the prompts and prompt tokens sent to it to prefill, ever (a copy)."""
        return dict(self._sent)

    def add(self, worker: str, tokens: int, arrival: bool = True) -> Callable[[], None]:
        self._tokens[worker] = self.tokens(worker) + tokens
        if arrival:
            total = self._sent.get(worker, Sent())
            self._sent[worker] = Sent(total.prompts + 1, total.tokens + tokens)
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                self._tokens[worker] -= tokens
        return finish


def kv_bytes_per_token(layout: dict[str, Any]) -> int:
    """2 (K and V) x layers x KV heads x head dim x dtype bytes, from a worker's `kv_layout`
    (the latent pool of MLA: layers x latent width x dtype bytes, its head_dim being the latent
    and kv_heads 1); 0 when the layout is unknown (no link cost counted)."""
    try:
        rows = 1 if layout.get("layout") == LAYOUT_PAGED_MLA else 2
        return rows * int(layout["num_layers"]) * int(layout["kv_heads"]) * \
            int(layout["head_dim"]) * DTYPE_BYTES[layout["dtype"]]
    except (AttributeError, KeyError, TypeError, ValueError):
        return 0


def _positive(value: object) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0 and \
        math.isfinite(value)
    return float(value) if ok else None


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None
