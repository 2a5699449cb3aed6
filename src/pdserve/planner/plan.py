"""A disaggregation plan for one workload: KV size, transfer, prefill, decode, ratio, verdict.

Definitions (all per TP group of `tp` GPUs, one "worker"):
- transfer_seconds: the prompt's KV on one GPU over that GPU's link (each rank ships its own
  shard in parallel; see kv_math for the bytes).
- prefill_seconds: one prompt alone (cost.prefill_time), the time its KV takes to exist.
- prefill worker-seconds per request: a prefill worker packs prompts into steps of up to
  PREFILL_BATCH_TOKENS tokens (a scheduler token budget), n = max(1, budget // prompt) per
  step, so it is the time of such a step / n (short prompts share one weight read).
- decode worker-seconds per request = decode steps x step time / decode batch, with
  decode steps = output_tokens - 1 (the prefill worker samples token 0) and the
  step taken at the mean context of a request's decode, prompt + output / 2.
- prefill_decode_ratio = prefill worker-seconds / decode worker-seconds: prefill workers needed
  per decode worker for the two pools to keep pace (None when there is no decode step).
- default decode batch: the most requests whose whole KV (prompt + output) fits on a GPU beside
  the weights in MEMORY_UTILIZATION of its memory, capped at DEFAULT_MAX_DECODE_BATCH, at least 1.

Verdict rules, in order (thresholds are rules of thumb for one request, not measurements; with a
load, plan_simulation.py replaces them with the simulated layouts' goodputs):
1. no decode step (output_tokens == 1): collocate.
2. transfer >= prefill (TRANSFER_COLLOCATE): collocate: recomputing beats shipping.
3. stall < one decode step (STALL_COLLOCATE): collocate: a shared worker's decodes stall
   less than a step, too little to pay for a transfer and a second pool. The stall is the
   prefill's compute time / decode step time: on a shared worker the prompt rides in a step
   that reads the weights anyway, so what it adds is its FLOPs.
4. transfer > TRANSFER_MARGINAL of prefill, or stall < STALL_MARGINAL decode steps: marginal.
5. otherwise: disaggregate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from pdserve.common.engine_options import PROMPT_PACK_TOKENS
from pdserve.planner.cost import (
    Efficiency,
    PhaseTime,
    decode_step_time,
    min_tp_for_weights,
    prefill_time,
    stored_weight_bytes_per_gpu,
)
from pdserve.planner.hardware import Hardware
from pdserve.planner.kv_math import (
    breakeven_link_gbps,
    check_link,
    check_tp,
    dtype_bytes,
    kv_bytes,
    kv_bytes_per_token,
    kv_bytes_per_token_per_rank,
    transfer_seconds,
)
from pdserve.planner.model_shape import ModelShape

DEFAULT_MAX_DECODE_BATCH = 256  # our cap on concurrent decodes per worker
# whole prompts one prefill step packs: pdserve's engine's rule (a longer prompt runs alone)
PREFILL_BATCH_TOKENS = PROMPT_PACK_TOKENS
MEMORY_UTILIZATION = 0.9  # share of device memory for weights + KV (vLLM's default
# gpu_memory_utilization); the rest is activations and runtime
TRANSFER_COLLOCATE = 1.0
TRANSFER_MARGINAL = 0.25
STALL_COLLOCATE = 1.0
STALL_MARGINAL = 4.0


class Verdict(StrEnum):
    DISAGGREGATE = "disaggregate"
    COLLOCATE = "collocate"
    MARGINAL = "marginal"


def _check_count(name: str, flag: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} ({flag}) must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Workload:
    """One request shape and the serving set-up it runs on."""

    prompt_tokens: int
    output_tokens: int
    link_gbps: float
    kv_dtype: str = "bf16"
    tp: int = 1
    decode_batch: int | None = None  # None: the default rule in the module docstring
    efficiency: Efficiency = field(default_factory=Efficiency)

    def __post_init__(self) -> None:
        _check_count("prompt_tokens", "--prompt-tokens", self.prompt_tokens)
        _check_count("output_tokens", "--output-tokens", self.output_tokens)
        check_link(self.link_gbps)
        dtype_bytes(self.kv_dtype, "kv_dtype (--kv-dtype)")
        check_tp(self.tp)
        if self.decode_batch is not None:
            _check_count("decode_batch", "--decode-batch", self.decode_batch)

    @property
    def decode_steps(self) -> int:
        return self.output_tokens - 1

    @property
    def mean_decode_context(self) -> float:
        """Mean tokens attended over a request's decode steps: prompt + output / 2."""
        return self.prompt_tokens + self.output_tokens / 2


@dataclass(frozen=True)
class Plan:
    """The planner's answer; JSON and text views are `plan_to_dict` and `render_text`."""

    model: ModelShape
    hardware: Hardware
    workload: Workload
    kv_bytes_per_token: int  # whole model, tp-independent
    kv_bytes_per_token_per_gpu: int
    kv_bytes: int  # the prompt's KV, whole model
    kv_bytes_per_gpu: int
    transfer_seconds: float
    prefill: PhaseTime  # one prompt alone
    prefill_step: PhaseTime  # a packed prefill step of prefill_batch prompts
    prefill_batch: int
    decode: PhaseTime
    decode_batch: int
    verdict: Verdict
    reason: str
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", Verdict(self.verdict))
        _check_count("decode_batch", "--decode-batch", self.decode_batch)
        _check_count("prefill_batch", "prefill step prompts", self.prefill_batch)
        if self.kv_bytes_per_gpu > self.kv_bytes:
            raise ValueError(f"kv_bytes_per_gpu ({self.kv_bytes_per_gpu}) cannot exceed the "
                             f"request's kv_bytes ({self.kv_bytes})")

    @property
    def prefill_seconds(self) -> float:
        return self.prefill.seconds

    @property
    def decode_step_seconds(self) -> float:
        return self.decode.seconds

    @property
    def prefill_worker_seconds(self) -> float:
        """Packed prefill step time / prompts in it: one request's share of a prefill worker."""
        return self.prefill_step.seconds / self.prefill_batch

    @property
    def decode_worker_seconds(self) -> float:
        """Decode steps x step time / batch: one request's share of a decode worker."""
        return self.workload.decode_steps * self.decode_step_seconds / self.decode_batch

    @property
    def prefill_decode_ratio(self) -> float | None:
        decode = self.decode_worker_seconds
        return self.prefill_worker_seconds / decode if decode > 0 else None

    @property
    def stall_steps(self) -> float:
        """Decode steps one prefill would stall on a collocated worker: its compute / step."""
        return self.prefill.compute_seconds / self.decode_step_seconds

    @property
    def transfer_share(self) -> float:
        return self.transfer_seconds / self.prefill_seconds

    @property
    def breakeven_link_gbps(self) -> float:
        """The link (Gb/s) at which the transfer takes as long as the prefill."""
        return breakeven_link_gbps(self.kv_bytes_per_gpu, self.prefill_seconds)


# ---- building a plan --------------------------------------------------------------------------


def _usable_memory(hw: Hardware) -> float:
    return hw.memory_bytes * MEMORY_UTILIZATION


def kv_room_tokens(shape: ModelShape, hw: Hardware, tp: int, kv_bytes_per_token_gpu: int
                   ) -> int:
    """The KV tokens a GPU holds beside the weights in MEMORY_UTILIZATION of its memory (a
    simulated worker's default KV capacity); ValueError when not even one fits."""
    free = _usable_memory(hw) - stored_weight_bytes_per_gpu(shape, tp)
    if free < kv_bytes_per_token_gpu:
        raise ValueError(f"{shape.name} weights leave no KV room on {hw.name} at tp {tp} "
                         f"({MEMORY_UTILIZATION:.0%} of memory): raise --tp")
    return int(free // kv_bytes_per_token_gpu)


def _weight_notes(shape: ModelShape, hw: Hardware, tp: int) -> list[str]:
    weights = stored_weight_bytes_per_gpu(shape, tp)
    if weights <= _usable_memory(hw):
        return []
    need = min_tp_for_weights(shape, _usable_memory(hw))
    return [f"weights need {_si(weights, 'B')} per GPU but {hw.name} has "
            f"{_si(_usable_memory(hw), 'B')} usable ({MEMORY_UTILIZATION:.0%} of "
            f"{_si(hw.memory_bytes, 'B')}): use --tp {need} or more (or more GPUs); "
            "times below assume it fits"]


def choose_decode_batch(shape: ModelShape, hw: Hardware, workload: Workload,
                        kv_per_token_gpu: int) -> tuple[int, list[str]]:
    """The decode batch (explicit, or the default rule) and notes on memory it needs."""
    free = _usable_memory(hw) - stored_weight_bytes_per_gpu(shape, workload.tp)
    per_request = kv_per_token_gpu * (workload.prompt_tokens + workload.output_tokens)
    if workload.decode_batch is not None:
        batch = workload.decode_batch
    else:
        batch = min(DEFAULT_MAX_DECODE_BATCH, max(1, math.floor(max(free, 0) / per_request)))
    if free > 0 and batch * per_request > free:
        return batch, [f"decode batch {batch} needs {_si(batch * per_request, 'B')} of KV per "
                       f"GPU but only {_si(free, 'B')} is free beside the weights"]
    return batch, []


def _tp_notes(shape: ModelShape, tp: int) -> list[str]:
    if tp == 1:
        return []
    notes = [f"--link-gbps is per GPU: each of the {tp} ranks ships its own KV shard at once"]
    if shape.is_mla:
        notes.append(f"MLA: the latent KV ({shape.kv_lora_rank} + {shape.qk_rope_head_dim} "
                     "values per layer) is replicated on every TP rank, not split: per-GPU KV "
                     "and transfer time do not shrink with --tp")
    elif tp > shape.num_kv_heads:
        notes.append(f"--tp {tp} exceeds the {shape.num_kv_heads} KV heads: each head is "
                     f"replicated on {tp // shape.num_kv_heads} ranks, one head per GPU")
    return notes


def _dtype_notes(shape: ModelShape, hw: Hardware) -> list[str]:
    if shape.weight_dtype == "fp8" and not hw.has_fp8:
        return [f"{hw.name} has no fp8 tensor cores: compute uses its bf16 peak"]
    return []


def _context_notes(shape: ModelShape, workload: Workload) -> list[str]:
    context = workload.prompt_tokens + workload.output_tokens
    limit = shape.max_position_embeddings
    if limit is None or context <= limit:
        return []
    return [f"prompt + output ({context:,} tokens) exceeds the model's max_position_embeddings "
            f"({limit:,}): the model cannot serve this request as is"]


def make_plan(shape: ModelShape, hw: Hardware, workload: Workload) -> Plan:
    """Every number of the plan, from the cost models, then the verdict on them."""
    tp, kv_dtype = workload.tp, workload.kv_dtype
    per_token = kv_bytes_per_token(shape, kv_dtype)
    per_token_gpu = kv_bytes_per_token_per_rank(shape, kv_dtype, tp)
    bytes_gpu = kv_bytes(per_token_gpu, workload.prompt_tokens)
    batch, batch_notes = choose_decode_batch(shape, hw, workload, per_token_gpu)
    eff = workload.efficiency
    prefill = prefill_time(shape, hw, workload.prompt_tokens, per_token_gpu, tp, eff)
    prefill_batch = max(1, PREFILL_BATCH_TOKENS // workload.prompt_tokens)
    prefill_step = prefill_time(shape, hw, workload.prompt_tokens, per_token_gpu, tp, eff,
                                prompts=prefill_batch)
    decode = decode_step_time(shape, hw, batch, workload.mean_decode_context, per_token_gpu,
                              tp, eff)
    notes = (_weight_notes(shape, hw, tp) + batch_notes + _tp_notes(shape, tp)
             + _dtype_notes(shape, hw) + _context_notes(shape, workload))
    plan = Plan(model=shape, hardware=hw, workload=workload, kv_bytes_per_token=per_token,
                kv_bytes_per_token_per_gpu=per_token_gpu,
                kv_bytes=kv_bytes(per_token, workload.prompt_tokens), kv_bytes_per_gpu=bytes_gpu,
                transfer_seconds=transfer_seconds(bytes_gpu, workload.link_gbps),
                prefill=prefill, prefill_step=prefill_step, prefill_batch=prefill_batch,
                decode=decode, decode_batch=batch,
                verdict=Verdict.MARGINAL, reason="", notes=tuple(notes))
    verdict, reason = decide(plan)
    return replace(plan, verdict=verdict, reason=reason)


# ---- the verdict ------------------------------------------------------------------------------


def decide(plan: Plan) -> tuple[Verdict, str]:
    """Apply the verdict rules of the module docstring; the reason names the deciding numbers."""
    w = plan.workload
    t, p, d = plan.transfer_seconds, plan.prefill_seconds, plan.decode_step_seconds
    link = f"{w.link_gbps:g} Gb/s"
    if w.decode_steps == 0:
        return Verdict.COLLOCATE, ("one output token: the answer is done at prefill, so there "
                                   "is no decode phase to protect")
    if plan.transfer_share >= TRANSFER_COLLOCATE:
        return Verdict.COLLOCATE, (
            f"moving the KV takes {_s(t)} over {link}, longer than the {_s(p)} prefill that "
            f"makes it: recomputing beats shipping (the link would need over "
            f"{plan.breakeven_link_gbps:.0f} Gb/s)")
    if plan.stall_steps < STALL_COLLOCATE:
        return Verdict.COLLOCATE, (
            f"a {w.prompt_tokens}-token prefill adds {_s(plan.prefill.compute_seconds)} of "
            f"compute, under one decode step ({_s(d)}): on a shared worker it delays running "
            "decodes by less than a step, too little to pay for a transfer and a second pool")
    doubts = _marginal_reasons(plan)
    if doubts:
        return Verdict.MARGINAL, "; and ".join(doubts)
    return Verdict.DISAGGREGATE, (
        f"the KV moves in {_s(t)} over {link}, {plan.transfer_share:.0%} of the {_s(p)} prefill, "
        f"while on a shared worker each {w.prompt_tokens}-token prefill would stall running "
        f"decodes for {plan.stall_steps:.0f} steps of {_s(d)}")


def _marginal_reasons(plan: Plan) -> list[str]:
    """Rule 4's reasons, each naming its numbers; empty when neither applies."""
    w = plan.workload
    t, p, d = plan.transfer_seconds, plan.prefill_seconds, plan.decode_step_seconds
    reasons = []
    if plan.transfer_share > TRANSFER_MARGINAL:
        reasons.append(
            f"the transfer ({_s(t)} over {w.link_gbps:g} Gb/s) is {plan.transfer_share:.0%} of "
            f"the {_s(p)} prefill, so it gives back much of what disaggregation saves (a link of "
            f"{plan.breakeven_link_gbps / TRANSFER_MARGINAL:.0f} Gb/s would bring it to "
            f"{TRANSFER_MARGINAL:.0%})")
    if plan.stall_steps < STALL_MARGINAL:
        reasons.append(
            f"a {w.prompt_tokens}-token prefill ({_s(plan.prefill.compute_seconds)} of compute) "
            f"stalls a shared worker's decodes for only {plan.stall_steps:.1f} steps of {_s(d)}, "
            "which chunked prefill on a collocated worker can absorb")
    return reasons


# ---- rendering ---------------------------------------------------------------------------------


def _si(value: float, unit: str) -> str:
    """Decimal SI prefix, 3-4 significant digits: 10.74 GB, 989.5 TFLOP/s."""
    for factor, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"),
                           (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.4g} {prefix}{unit}"
    return f"{value:.4g} {unit}"


def _s(seconds: float) -> str:
    """Seconds with 3 decimals (0.859 s), or milliseconds below 10 ms."""
    return f"{seconds:.3f} s" if seconds >= 0.01 else f"{seconds * 1e3:.3f} ms"


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """Machine-readable plan: full-precision numbers, bytes as ints, seconds as floats."""
    m, w, hw = plan.model, plan.workload, plan.hardware
    return {
        "model": m.name, "attention": str(m.attention), "gpu": hw.name, "tp": w.tp,
        "prompt_tokens": w.prompt_tokens, "output_tokens": w.output_tokens,
        "link_gbps": w.link_gbps, "kv_dtype": w.kv_dtype, "weight_dtype": m.weight_dtype,
        "params_total": m.params_total, "params_active": m.params_active,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "kv_bytes_per_token_per_gpu": plan.kv_bytes_per_token_per_gpu,
        "kv_bytes": plan.kv_bytes, "kv_bytes_per_gpu": plan.kv_bytes_per_gpu,
        "transfer_seconds": plan.transfer_seconds,
        "breakeven_link_gbps": plan.breakeven_link_gbps,
        "prefill_seconds": plan.prefill_seconds, "prefill_bound": plan.prefill.bound,
        "prefill_flops_per_gpu": plan.prefill.flops,
        "decode_step_seconds": plan.decode_step_seconds, "decode_bound": plan.decode.bound,
        "decode_batch": plan.decode_batch, "decode_steps": w.decode_steps,
        "decode_bytes_per_gpu": plan.decode.bytes,
        "prefill_batch": plan.prefill_batch,
        "prefill_worker_seconds": plan.prefill_worker_seconds,
        "decode_worker_seconds": plan.decode_worker_seconds,
        "prefill_decode_ratio": plan.prefill_decode_ratio,
        "stall_steps": plan.stall_steps, "mfu": w.efficiency.mfu, "mbu": w.efficiency.mbu,
        "verdict": str(plan.verdict), "reason": plan.reason, "notes": list(plan.notes),
    }


def _count(n: int) -> str:
    """Parameter count the way model cards write it: 70.55B, 134.5M."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _model_line(m: ModelShape) -> str:
    if m.is_mla:
        kv = f"MLA, {m.num_layers} layers x ({m.kv_lora_rank} + {m.qk_rope_head_dim}) latent"
    else:
        kv = f"GQA, {m.num_layers} layers x {m.num_kv_heads} KV heads x head_dim {m.head_dim}"
    return (f"{kv}; {_count(m.params_total)} params ({_count(m.params_active)} active), "
            f"{m.weight_dtype} weights")


def _kv_rows(plan: Plan) -> list[tuple[str, str]]:
    w = plan.workload
    return [
        ("KV per token", f"{plan.kv_bytes_per_token:,} B ({w.kv_dtype}); "
                         f"per GPU {plan.kv_bytes_per_token_per_gpu:,} B"),
        ("KV per request", f"{plan.kv_bytes:,} B ({_si(plan.kv_bytes, 'B')}) for "
                           f"{w.prompt_tokens:,} prompt tokens; "
                           f"per GPU {plan.kv_bytes_per_gpu:,} B"),
        ("transfer", f"{_s(plan.transfer_seconds)} over {w.link_gbps:g} Gb/s per GPU "
                     f"(break-even link {plan.breakeven_link_gbps:.4g} Gb/s)"),
    ]


def _cost_rows(plan: Plan) -> list[tuple[str, str]]:
    w, hw, pf, dc = plan.workload, plan.hardware, plan.prefill, plan.decode
    peak = hw.peak_flops(plan.model.weight_dtype)
    return [
        ("prefill", f"{_s(pf.seconds)}, {pf.bound}-bound ({_si(pf.flops, 'FLOP')} at "
                    f"{_si(peak, 'FLOP/s')} x MFU {w.efficiency.mfu:g}; {_si(pf.bytes, 'B')} "
                    f"at {_si(hw.memory_bandwidth, 'B/s')} x MBU {w.efficiency.mbu:g})"),
        ("decode step", f"{_s(dc.seconds)} at batch {plan.decode_batch}, {dc.bound}-bound "
                        f"({_si(dc.bytes, 'B')} read, {_si(dc.flops, 'FLOP')}; mean context "
                        f"{w.mean_decode_context:,.0f} tokens)"),
    ]


def _ratio_line(plan: Plan) -> str:
    ratio = plan.prefill_decode_ratio
    head = (f"prefill {_s(plan.prefill_worker_seconds)} vs decode "
            f"{_s(plan.decode_worker_seconds)} worker-time per request")
    if ratio is None:
        return f"{head}: no decode steps"
    return f"{head} -> {ratio:.3g} prefill workers per decode worker"


def render_text(plan: Plan, before_verdict: Sequence[str] = ()) -> str:
    """Human-readable table of the plan: one labelled row per figure, `before_verdict` lines
    (a simulation's table), the verdict, then the notes."""
    m, w = plan.model, plan.workload
    rows = [("model", _model_line(m)), *_kv_rows(plan), *_cost_rows(plan),
            ("P:D ratio", _ratio_line(plan))]
    head = (f"pdserve plan: {m.name} on {plan.hardware.name} x tp {w.tp}; prompt "
            f"{w.prompt_tokens:,} + output {w.output_tokens:,} tokens; link {w.link_gbps:g} Gb/s")
    lines = [head] + [f"  {k:<15}{v}" for k, v in rows]
    lines += [f"  {line}" for line in before_verdict]
    lines.append(f"  {'verdict':<15}{plan.verdict.upper()}: {plan.reason}")
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)
