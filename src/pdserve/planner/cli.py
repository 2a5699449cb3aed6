"""`pdserve plan`: the planner's sub-command. `add_plan_parser` registers it on a subparsers
object; its handler returns the exit status (0, or 2 after `pdserve: error: ...` on bad input).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from pdserve.planner.cost import DEFAULT_MBU, DEFAULT_MFU, Efficiency
from pdserve.planner.hardware import HARDWARE, get_hardware
from pdserve.planner.kv_math import DTYPE_BYTES, dtype_bytes
from pdserve.planner.measured_link import MeasuredLink, parse_link_gbps
from pdserve.planner.model_shape import PRESETS, load_model_shape
from pdserve.planner.plan import (
    DEFAULT_MAX_DECODE_BATCH,
    MEMORY_UTILIZATION,
    Plan,
    Workload,
    make_plan,
    plan_to_dict,
    render_text,
)
from pdserve.planner.plan_simulation import (
    Load,
    render_simulation,
    simulate_plan,
    simulation_to_dict,
    with_simulation,
)
from pdserve.planner.simulate.cli import DEFAULT_SLO
from pdserve.planner.simulate.metrics import Slo

_DESCRIPTION = (
    "Should this workload run disaggregated? From a model preset or a Hugging Face config.json "
    "(GQA or MLA), report the KV bytes per token and per request, the time to move them over "
    "the link, the prefill time (roofline: FLOPs / (peak x MFU)), the decode step time (bytes "
    "read / (memory bandwidth x MBU)), the prefill:decode worker ratio, and a verdict "
    "(disaggregate, collocate or marginal) with its reason. Without a load the verdict is a "
    "rule of thumb for one request; with --rate or --concurrency the simulator serves the "
    "request shape on each layout of the same hardware (collocated, chunked, disaggregated "
    "P+D) and the verdict is the layout with the most requests within the SLO."
)
_EPILOG = (
    "KV bytes/token: GQA 2 x layers x kv_heads x head_dim x bytes; MLA layers x (kv_lora_rank "
    "+ qk_rope_head_dim) x bytes. Transfer: bytes x 8 / (Gb/s x 1e9). With --tp N, GQA KV heads "
    "split across ranks while the MLA latent is replicated on every rank; each rank ships its "
    "own shard over its own link. The default decode batch is the most requests whose KV fits "
    f"beside the weights in {MEMORY_UTILIZATION:.0%} of device memory, capped at "
    f"{DEFAULT_MAX_DECODE_BATCH}. Example: pdserve plan --model llama-3.1-70b --prompt-tokens "
    "32768 --output-tokens 256 --link-gbps 100 --gpu H100 --tp 8. At a load, on this machine: "
    "pdserve plan --model smollm2-135m --gpu cpu --prompt-tokens 1750 --output-tokens 56 "
    "--link-gbps 20 --rate 0.4 [--calibrate cmp.steps.json]"
)


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `plan` on `subparsers` with func = the handler."""
    p = subparsers.add_parser("plan", help="size KV transfer, prefill and decode; say whether "
                                           "disaggregation pays", description=_DESCRIPTION,
                              epilog=_EPILOG)
    _add_workload_args(p)
    _add_hardware_args(p)
    _add_load_args(p)
    p.add_argument("--json", action="store_true",
                   help="print the plan as one JSON object instead of a table")
    p.set_defaults(func=run_plan)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help=f"a preset ({', '.join(PRESETS)}) or the path of a Hugging Face "
                        "config.json (or of the folder holding it)")
    p.add_argument("--prompt-tokens", type=int, required=True,
                   help="prompt length in tokens (the KV that moves)")
    p.add_argument("--output-tokens", type=int, required=True,
                   help="generated tokens per request (token 0 comes from prefill)")
    p.add_argument("--link-gbps", required=True,
                   help="link speed per GPU between prefill and decode, in Gb/s (e.g. 100, "
                        "400), or a running router's URL (http://HOST:PORT): the median rate "
                        "of the KV links it measured")
    p.add_argument("--metrics-key-file", default=None,
                   help="with a router URL: a file holding the key its /metrics asks for")
    p.add_argument("--kv-dtype", default="bf16",
                   help=f"KV cache format: {', '.join(DTYPE_BYTES)} (default: %(default)s)")
    p.add_argument("--weight-dtype", default=None,
                   help="weight format (bf16, fp16, fp8); default: the checkpoint's own (fp8 for "
                        "deepseek-v3, else bf16)")
    p.add_argument("--decode-batch", type=int, default=None,
                   help="concurrent requests per decode worker (default: the most whose KV "
                        f"fits, at most {DEFAULT_MAX_DECODE_BATCH})")


def _add_hardware_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", default="H100",
                   help=f"device preset, any case: {', '.join(h.upper() for h in HARDWARE)} "
                        "(default: %(default)s)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel GPUs per worker, on both sides (default: %(default)s)")
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                   help="model FLOPs utilization the prefill reaches, in (0, 1] (default: "
                        "%(default)s, an assumption: calibrate it)")
    p.add_argument("--mbu", type=float, default=DEFAULT_MBU,
                   help="fraction of memory bandwidth the decode reaches, in (0, 1] (default: "
                        "%(default)s, an assumption: calibrate it)")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=None,
                   help="simulate the layouts at this many req/s (Poisson) and take the verdict "
                        "from their goodput")
    p.add_argument("--concurrency", type=int, default=None,
                   help="instead of --rate: this many clients, each sending its next request "
                        "when its last one ends")
    p.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_SLO.ttft_ms,
                   help="goodput counts requests with TTFT at most this (default: %(default)g)")
    p.add_argument("--slo-tpot-ms", type=float, default=DEFAULT_SLO.tpot_ms,
                   help="and TPOT at most this (default: %(default)g); also the pace of local "
                        "prefills on decode workers")
    p.add_argument("--workers", type=int, default=2,
                   help="worker slots the layouts share: on a GPU each is --tp GPUs; on a CPU "
                        "machine the cores are split among that many workers (default: "
                        "%(default)s)")
    p.add_argument("--calibrate", default=None, metavar="FILE",
                   help="step costs measured instead of the roofline: the .steps.json of a "
                        "`pdserve bench compare` run (each configuration simulated with its own "
                        "fit), or on a GPU a profile JSON or `bench engine --json` rows")


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan (table or JSON), simulated at the load when one is given. Bad input
    raises ValueError, which `pdserve.cli.main` reports as `pdserve: error: ...` with exit
    status 2."""
    plan = _make(args)
    load = _load(args)
    if load is None:
        print(json.dumps(plan_to_dict(plan), indent=2) if args.json else render_text(plan))
        return 0
    sim = simulate_plan(plan, load, args.calibrate)
    plan = with_simulation(plan, sim)
    if args.json:
        print(json.dumps({**plan_to_dict(plan), "verdict_from": "simulation",
                          "simulation": simulation_to_dict(sim)}, indent=2))
    else:
        print(render_text(plan, render_simulation(sim)))
    return 0


def _load(args: argparse.Namespace) -> Load | None:
    """The load to simulate at, or None (rules of thumb); simulation flags without a load are
    refused rather than ignored."""
    if args.rate is None and args.concurrency is None:
        if args.calibrate is not None:
            raise ValueError("--calibrate prices a simulation: give --rate or --concurrency")
        return None
    return Load(rate=args.rate, concurrency=args.concurrency,
                slo=Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms),
                workers=args.workers)


def _link_gbps(args: argparse.Namespace) -> float:
    key = None
    if args.metrics_key_file:
        key = Path(args.metrics_key_file).read_text().strip()
    link = parse_link_gbps(args.link_gbps, key)
    if isinstance(link, MeasuredLink):
        print(link.describe(), file=sys.stderr)
        return link.gbps
    return link


def _make(args: argparse.Namespace) -> Plan:
    """Validate in order: workload numbers, device, weight format, then the model."""
    workload = Workload(prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                        link_gbps=_link_gbps(args), kv_dtype=args.kv_dtype, tp=args.tp,
                        decode_batch=args.decode_batch,
                        efficiency=Efficiency(mfu=args.mfu, mbu=args.mbu))
    hardware = get_hardware(args.gpu)
    shape = load_model_shape(args.model)
    if args.weight_dtype is not None:
        dtype_bytes(args.weight_dtype, "weight_dtype (--weight-dtype)")
        shape = replace(shape, weight_dtype=args.weight_dtype)
    return make_plan(shape, hardware, workload)
