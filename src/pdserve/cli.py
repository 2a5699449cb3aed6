"""`pdserve` command line: one sub-command per job."""

from __future__ import annotations

import argparse
import sys
import time

from pdserve.bench.cli import add_bench_parser
from pdserve.cli_args import add_cpu_kernels_arg, add_device_arg, add_model_args
from pdserve.cluster.up import add_up_parser
from pdserve.ctl.cli import add_ctl_parser
from pdserve.k8s.cli import add_k8s_parser, add_operator_parser
from pdserve.planner.cli import add_plan_parser
from pdserve.planner.simulate.cli import add_simulate_parser
from pdserve.router.app import add_router_parser
from pdserve.testbed.cli import add_testbed_parser
from pdserve.workers.settings import add_worker_parser


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_device_arg(p)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context)")
    add_cpu_kernels_arg(p)


def _generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, cpu_kernels=args.cpu_kernels)
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


def build_parser() -> argparse.ArgumentParser:
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
    add_worker_parser(sub)
    add_router_parser(sub)
    add_up_parser(sub)
    add_ctl_parser(sub)
    add_bench_parser(sub)
    add_plan_parser(sub)
    add_simulate_parser(sub)
    add_k8s_parser(sub)
    add_operator_parser(sub)
    add_testbed_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
