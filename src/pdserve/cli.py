"""`pdserve` command line: one sub-command per job."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from pdserve.cli_args import (
    add_cpu_kernels_arg,
    add_device_arg,
    add_enforce_eager_arg,
    add_model_args,
)

# Every sub-command but `generate`: its name -> (module, function adding its parser), in the
# order `pdserve --help` lists them. A run imports only its own command's module (the router's
# pulls in transformers, ~1.3 s): `pdserve ctl` or `pdserve up` start without it.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "worker": ("pdserve.workers.settings", "add_worker_parser"),
    "router": ("pdserve.router.app", "add_router_parser"),
    "up": ("pdserve.cluster.up", "add_up_parser"),
    "ctl": ("pdserve.ctl.cli", "add_ctl_parser"),
    "bench": ("pdserve.bench.cli", "add_bench_parser"),
    "plan": ("pdserve.planner.cli", "add_plan_parser"),
    "simulate": ("pdserve.planner.simulate.cli", "add_simulate_parser"),
    "k8s": ("pdserve.k8s.cli", "add_k8s_parser"),
    "operator": ("pdserve.k8s.cli", "add_operator_parser"),
    "testbed": ("pdserve.testbed.cli", "add_testbed_parser"),
}


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_device_arg(p)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context)")
    add_cpu_kernels_arg(p)
    add_enforce_eager_arg(p)


def _generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, cpu_kernels=args.cpu_kernels,
              enforce_eager=args.enforce_eager)
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    t0 = time.perf_counter()
    if args.raw or not getattr(llm.get_tokenizer(), "chat_template", None):
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)
    gen_s = time.perf_counter() - t0
    completion = out.outputs[0]
    print(completion.text)
    n = len(completion.token_ids)
    print(f"[{n} tokens in {gen_s:.2f} s ({n / gen_s:.1f} tok/s), finish_reason="
          f"{completion.finish_reason}, model loaded in {load_s:.1f} s]", file=sys.stderr)
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every sub-command's parser; only `generate`'s and `command`'s where `command` names a
    sub-command, so that no other command's module is imported."""
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt with the offline engine",
                         description="Generate text for one prompt. Instruct models get the "
                                     "prompt as a user turn of their chat template.")
    gen.add_argument("prompt")
    _add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64, help="default: %(default)s")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0 is greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, help="default: %(default)s")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as plain text, without the chat template")
    gen.set_defaults(func=_generate)
    every = command not in (*SUBCOMMANDS, "generate")
    for name, (module, add_parser) in SUBCOMMANDS.items():
        if every or name == command:
            getattr(importlib.import_module(module), add_parser)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
