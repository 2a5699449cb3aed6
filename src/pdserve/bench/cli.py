"""`pdserve bench`: one sub-command per benchmark. The modules that measure are imported only
when their benchmark runs (some load torch), so `pdserve --help` and every `pdserve bench X
--help` stay torch-free."""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.bench.chaos.cli import DESCRIPTION as CHAOS_DESCRIPTION
from pdserve.bench.chaos.cli import add_chaos_args, run_chaos_cli
from pdserve.bench.compare import add_compare_args, run_compare_cli
from pdserve.bench.flip.cli import DESCRIPTION as FLIP_DESCRIPTION
from pdserve.bench.flip.cli import add_flip_args, run_flip_cli
from pdserve.bench.serve.runner import add_bench_serve_args, run_bench_serve
from pdserve.bench.simulator_check import add_simulator_check_args, run_simulator_check_cli
from pdserve.cli_args import (
    add_cpu_kernels_arg,
    add_device_arg,
    add_enforce_eager_arg,
    add_tensor_parallel_arg,
)
from pdserve.common.engine_options import DTYPE_CHOICES, DTYPE_HELP


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """`pdserve bench` and one sub-command per benchmark."""
    bench = subparsers.add_parser(
        "bench", help="benchmarks, each beside a baseline measured in the same run")
    kinds = bench.add_subparsers(dest="bench", required=True)
    for add in (_add_engine, _add_decode_context, _add_attention, _add_decode_attention,
                _add_linear, _add_sampler, _add_transfer,
                _add_layerwise, _add_serve, _add_compare, _add_simulator, _add_router,
                _add_hostile, _add_chaos, _add_flip, _add_moe, _add_moe_ops):
        add(kinds)


def _add_engine(kinds: argparse._SubParsersAction) -> None:
    eng = kinds.add_parser(
        "engine", help="decode and prefill tok/s vs transformers and the roofline",
        description="Decode tok/s at several batch sizes and prefill tok/s at several prompt "
                    "lengths (and with half a prompt in the prefix cache), each beside "
                    "transformers generate() in the same process and the roofline from this "
                    "machine's measured memory bandwidth and matmul peak (on --device cuda: the "
                    "GPU's). Medians of --repeats runs.")
    eng.add_argument("--model", default="smollm2", help="default: %(default)s")
    eng.add_argument("--batches", default="1,8,32", help="decode batch sizes (default: "
                                                         "%(default)s)")
    eng.add_argument("--decode-steps", type=int, default=32, help="default: %(default)s")
    eng.add_argument("--prompt-lens", default="512,1000,2048,8191",
                     help="prefill prompt lengths in tokens (default: %(default)s; 8,191 is "
                          "SmolLM2's 8,192 positions less the sampled token)")
    eng.add_argument("--cached-len", type=int, default=2048,
                     help="the prefix-cache row's prompt, its first half cached (default: "
                          "%(default)s; 0: no such row)")
    eng.add_argument("--chunk", type=int, default=256,
                     help="also prefill the --cached-len prompt this many tokens a step "
                          "(default: %(default)s; 0: no such row)")
    eng.add_argument("--repeats", type=int, default=3, help="default: %(default)s")
    eng.add_argument("--json", action="store_true", help="one JSON object per measurement")
    eng.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES),
                     help="both engines' weights and KV, and the matmul roof's; " + DTYPE_HELP)
    add_cpu_kernels_arg(eng)
    add_tensor_parallel_arg(eng)
    add_device_arg(eng)
    add_enforce_eager_arg(eng)
    eng.set_defaults(func=_bench_engine)


def _add_moe(kinds: argparse._SubParsersAction) -> None:
    moe = kinds.add_parser(
        "moe", help="MoE decode: bytes a step reads (only the chosen experts) vs its time",
        description="Decode steps of a DeepSeek-V3-shaped and a Qwen3-MoE-shaped random-weight "
                    "model (bf16, written to a temporary folder) at each batch size: the weight "
                    "bytes a step must read (dense tensors plus the experts its routers chose, "
                    "recorded by hooks), the step time turned into bytes at this machine's read "
                    "bandwidth measured in the same run, their ratio (1.0: only the needed "
                    "bytes, at full bandwidth), and the bytes if every expert were read. "
                    "Medians of --repeats runs.")
    moe.add_argument("--models", default="deepseek_v3,qwen3_moe", help="default: %(default)s")
    moe.add_argument("--batches", default="1,4", help="decode batch sizes (default: "
                                                      "%(default)s)")
    moe.add_argument("--hidden", type=int, default=1024, help="hidden size (default: "
                                                              "%(default)s)")
    moe.add_argument("--experts", type=int, default=64,
                     help="routed experts per MoE layer (default: %(default)s)")
    moe.add_argument("--expert-width", type=int, default=512,
                     help="one expert's SwiGLU width (default: %(default)s)")
    moe.add_argument("--layers", type=int, default=4, help="default: %(default)s")
    moe.add_argument("--prompt-len", type=int, default=16, help="default: %(default)s")
    moe.add_argument("--decode-steps", type=int, default=16, help="default: %(default)s")
    moe.add_argument("--repeats", type=int, default=3, help="default: %(default)s")
    moe.add_argument("--threads", type=int, default=None,
                     help="torch threads for the steps and the bandwidth (default: every core)")
    moe.add_argument("--json", action="store_true", help="one JSON object per measurement")
    moe.set_defaults(func=_bench_moe)


def _add_moe_ops(kinds: argparse._SubParsersAction) -> None:
    ops = kinds.add_parser(
        "moe-ops", help="MoE/MLA decode operators vs the PyTorch path they replace",
        description="One call of each compiled operator of a MoE or MLA decode layer (MLA's "
                    "absorbed decode attention, DeepSeek's router, Qwen3-MoE's gate and "
                    "routing) beside the engine's PyTorch path for the same inputs, at a real "
                    "layer's shape, bf16, each call after a cache flush (the weights come from "
                    "memory, as in a step). Both sides' outputs are compared first. Medians of "
                    "--repeats calls.")
    ops.add_argument("--hidden", type=int, default=2048, help="default: %(default)s")
    ops.add_argument("--heads", type=int, default=16, help="MLA heads (default: %(default)s)")
    ops.add_argument("--kv-lora-rank", type=int, default=512, help="default: %(default)s")
    ops.add_argument("--batches", default="1,4", help="decode batch sizes (default: "
                                                      "%(default)s)")
    ops.add_argument("--contexts", default="256,2048",
                     help="MLA context lengths in positions (default: %(default)s)")
    ops.add_argument("--experts", type=int, default=64,
                     help="DeepSeek's routed experts (default: %(default)s)")
    ops.add_argument("--qwen3-experts", type=int, default=128, help="default: %(default)s")
    ops.add_argument("--repeats", type=int, default=20, help="default: %(default)s")
    ops.add_argument("--json", action="store_true", help="one JSON object per measurement")
    ops.set_defaults(func=_bench_moe_ops)


def _add_transfer(kinds: argparse._SubParsersAction) -> None:
    xfer = kinds.add_parser(
        "transfer", help="KV transfer GB/s per transport and mode vs memcpy and a raw socket",
        description="Moves KV payloads between this process and a child process over each "
                    "transport, push (write) and pull (read), beside memcpy and a raw loopback "
                    "socket measured in the same run; then the fixed overhead of a whole push "
                    "session for a 1,000-token SmolLM2-shaped prompt and the CRC32C cost. "
                    "Medians of --repeats runs. With --testbed (root): between two hosts of a "
                    "testbed made for the run, over links shaped to each --link-gbps: bulk "
                    "Gb/s against the link's rate, and bursts of --concurrent transfers: raw "
                    "sockets, the default (link window, control messages on a connection of "
                    "their own), the window on one connection, and neither (each transfer's "
                    "tail against the ideal, and the latency of control messages sent "
                    "meanwhile); with --senders K > 1, "
                    "K prefill hosts push into one decode host whose link is the bottleneck "
                    "(each sender's share, Jain's index, control latency per sender). With "
                    "--device cuda: both pools in that GPU's memory, nixl only, beside a "
                    "device-to-device copy.")
    xfer.add_argument("--sizes", default="1,4,16,64,256",
                      help="payload sizes in MiB (default: %(default)s)")
    xfer.add_argument("--repeats", type=int, default=3, help="default: %(default)s")
    xfer.add_argument("--json", action="store_true", help="one JSON object per measurement")
    xfer.add_argument("--testbed", action="store_true",
                      help="measure across two testbed hosts over a shaped link (root)")
    xfer.add_argument("--link-gbps", default="1,10",
                      help="with --testbed: link rates in Gb/s (default: %(default)s)")
    xfer.add_argument("--delay-ms", type=float, default=0.0,
                      help="with --testbed: one-way link delay (netem or iptables; default: 0)")
    xfer.add_argument("--loss-pct", type=float, default=0.0,
                      help="with --testbed: percent of packets every link drops in each "
                           "direction (default: 0)")
    xfer.add_argument("--concurrent", default="1,8,32",
                      help="with --testbed: transfers started at once (default: %(default)s)")
    xfer.add_argument("--senders", default="1",
                      help="with --testbed: prefill hosts pushing at once into one decode host, "
                           "each starting --concurrent writes; 1 gives the bulk and burst rows, "
                           "more the incast rows (default: %(default)s)")
    xfer.add_argument("--congestion", default="", metavar="NAME",
                      help="with --testbed: the TCP congestion control the endpoints ask for "
                           "on the connections they dial, e.g. cubic (default: the host's)")
    add_device_arg(xfer)
    xfer.set_defaults(func=_bench_transfer)


def _add_attention(kinds: argparse._SubParsersAction) -> None:
    att = kinds.add_parser(
        "attention", help="the compiled prefill attention vs PyTorch's SDPA, same shapes",
        description="One layer's causal prefill attention at several prompt lengths, "
                    "pdserve's compiled kernel over a paged pool beside PyTorch's SDPA on the "
                    "same K/V (bf16, this process's threads): milliseconds, GFLOP/s over the "
                    "causal pairs, and the speed-up. Medians of --repeats runs of each.")
    att.add_argument("--prompt-lens", default="512,1000,2048,8191",
                     help="query rows (default: %(default)s)")
    att.add_argument("--cached", type=int, default=0,
                     help="context positions before the prompt, as after a prefix-cache hit "
                          "or earlier chunks (default: %(default)s)")
    att.add_argument("--shape", default="9,3,64",
                     help="heads,kv_heads,head_dim (default: %(default)s, SmolLM2-135M)")
    att.add_argument("--repeats", type=int, default=5, help="default: %(default)s")
    att.add_argument("--kernel", choices=("amx", "avx512_bf16", "avx2"), default="",
                     help="time this one of pdserve's kernels (AMX tiles, VDPBF16PS, fp32 FMAs) "
                          "where the CPU runs it (default: the one the engine takes here)")
    att.add_argument("--json", action="store_true", help="one JSON object per length")
    att.set_defaults(func=_bench_attention)


def _add_linear(kinds: argparse._SubParsersAction) -> None:
    lin = kinds.add_parser(
        "linear", help="pdserve's bf16 linear kernel vs oneDNN's, a decoder layer's shapes",
        description="A decoder layer's four linears (qkv, o, gate_up, down) at several row "
                    "counts, through the linear kernel the engine takes on this CPU (AMX, "
                    "VDPBF16PS or fp32 FMAs) beside oneDNN on the same weight prepacked (bf16, "
                    "this process's threads): milliseconds, GFLOP/s and the speed-up. The two "
                    "alternate in --rounds rounds of --repeats calls each; medians over the "
                    "rounds.")
    lin.add_argument("--rows", default="1,32,512,1000,2048",
                     help="rows of x: batch size of a decode step, or prompt tokens "
                          "(default: %(default)s)")
    lin.add_argument("--shape", default="576,1536,9,3,64",
                     help="hidden,intermediate,heads,kv_heads,head_dim (default: %(default)s, "
                          "SmolLM2-135M)")
    lin.add_argument("--repeats", type=int, default=5, help="calls per round (default: "
                                                              "%(default)s)")
    lin.add_argument("--rounds", type=int, default=5, help="default: %(default)s")
    lin.add_argument("--json", action="store_true", help="one JSON object per row count and "
                                                         "linear")
    lin.set_defaults(func=_bench_linear)


def _add_sampler(kinds: argparse._SubParsersAction) -> None:
    smp = kinds.add_parser(
        "sampler", help="what drawing a decode step's tokens costs: greedy, sampled, seeded",
        description="The engine's sampler on a batch of bf16 logit rows (a decode step's), "
                    "each way of drawing timed in the same rounds: greedy, temperature 1 "
                    "unseeded (one uniform per row, the inverse CDF), temperature 1 seeded "
                    "(the exponential race: a uniform per vocabulary entry; the baseline), and "
                    "top-p 0.9. Milliseconds per call, medians over the rounds, and the race's "
                    "time over the unseeded draw's.")
    smp.add_argument("--batches", default="1,16,64",
                     help="rows per call (default: %(default)s)")
    smp.add_argument("--vocab", type=int, default=49152,
                     help="entries per row (default: %(default)s, SmolLM2's)")
    smp.add_argument("--scale", type=float, default=3.0,
                     help="the logits are normal x this: larger is more peaked (default: "
                          "%(default)s)")
    smp.add_argument("--repeats", type=int, default=5, help="calls per round and way "
                                                              "(default: %(default)s)")
    smp.add_argument("--rounds", type=int, default=7, help="default: %(default)s")
    smp.add_argument("--json", action="store_true", help="one JSON object per batch size")
    smp.set_defaults(func=_bench_sampler)


def _add_decode_attention(kinds: argparse._SubParsersAction) -> None:
    dec = kinds.add_parser(
        "decode-attention",
        help="the compiled paged decode attention vs PyTorch and a plain read of its KV",
        description="One layer's decode attention (one new query per stream over its whole "
                    "context, the blocks scattered over the pool) at several batch sizes and "
                    "context lengths: pdserve's compiled kernel beside the engine's PyTorch path "
                    "(gather and SDPA) and beside a plain read of the same KV bytes (the "
                    "memory's speed, this kernel's roof), bf16, this process's threads, each "
                    "call after a cache flush. Medians of --repeats calls.")
    dec.add_argument("--batches", default="1,8", help="streams (default: %(default)s)")
    dec.add_argument("--contexts", default="512,2048,8192",
                     help="positions each stream attends to (default: %(default)s)")
    dec.add_argument("--shape", default="9,3,64",
                     help="heads,kv_heads,head_dim (default: %(default)s, SmolLM2-135M)")
    dec.add_argument("--repeats", type=int, default=9, help="default: %(default)s")
    dec.add_argument("--json", action="store_true", help="one JSON object per measurement")
    dec.set_defaults(func=_bench_decode_attention)


def _add_layerwise(kinds: argparse._SubParsersAction) -> None:
    lw = kinds.add_parser(
        "layerwise", help="what layer-wise KV streaming saves on one long prompt",
        description="This process prefills a prompt with the real model on one core while a "
                    "child process on another core receives its KV (reservation, checksums, "
                    "verification), once with the KV written after token 0 and once layer by "
                    "layer during the prefill; prints the medians of prefill time, KV ready "
                    "after token 0 and prompt to KV ready, and the saving. With --device cuda "
                    "both sides keep their KV in that GPU's memory (nixl only).")
    lw.add_argument("--model", default="smollm2", help="default: %(default)s")
    lw.add_argument("--transport", default="tcp", help="tcp, tcp-aes or nixl (default: "
                                                       "%(default)s)")
    lw.add_argument("--prompt-tokens", type=int, default=1000, help="default: %(default)s")
    lw.add_argument("--repeats", type=int, default=5, help="default: %(default)s")
    lw.add_argument("--json", action="store_true", help="one JSON object per mode")
    add_device_arg(lw)
    lw.set_defaults(func=_bench_layerwise)


def _add_serve(kinds: argparse._SubParsersAction) -> None:
    serve = kinds.add_parser(
        "serve", help="replay a workload against any OpenAI-compatible server (vLLM's metrics)",
        description="Open-loop (Poisson, --rate) or closed-loop (--concurrency) streaming "
                    "completions with token-id prompts of exact lengths, so every server sees "
                    "the same work; reports TTFT, TPOT, ITL and E2E (mean, median, P90, P99), "
                    "throughput and goodput under SLOs, client side, with vLLM bench serve's "
                    "JSON names.")
    add_bench_serve_args(serve)
    serve.set_defaults(func=run_bench_serve)


def _add_compare(kinds: argparse._SubParsersAction) -> None:
    cmp = kinds.add_parser(
        "compare", help="collocated vs collocated-chunked vs disaggregated (and vLLM) on the "
                        "same cores and trace",
        description="Starts each pdserve configuration with `pdserve up` on the same cores, "
                    "replays the same trace against each in turn (and against --external "
                    "servers), and prints one table with every metric and its ratio to the "
                    "first configuration; --plots draws latency CDFs and a per-worker "
                    "timeline of engine steps.")
    add_compare_args(cmp)
    cmp.set_defaults(func=run_compare_cli)


def _add_simulator(kinds: argparse._SubParsersAction) -> None:
    sim = kinds.add_parser(
        "simulator", help="held-out validation of `pdserve simulate` against measured runs",
        description="Measures a calibration workload and held-out workloads with `bench "
                    "compare` (each configuration on the same cores), fits each "
                    "configuration's step costs on the calibration run alone, simulates every "
                    "held-out run, and prints simulated against measured figures with their "
                    "errors, and whether the best configuration by goodput agrees. Exit status "
                    "1 when a figure is outside its tolerance or a ranking disagrees. Results "
                    "in --out are reused: --remeasure after the engine's speed changed.")
    add_simulator_check_args(sim)
    sim.set_defaults(func=run_simulator_check_cli)
    rep = kinds.add_parser(
        "simulator-repeat", help="two bench simulator runs: which misses are noise",
        description="Reads two `bench simulator` summaries of the same workloads measured at "
                    "different times and prints, for each figure that is not within "
                    "tolerance in both, the run-to-run change of the measured figure beside "
                    "each run's simulated error: noise (the measured change alone is over the "
                    "tolerance), model (both runs miss on the same side), or one run.")
    rep.add_argument("a", type=Path, help="the first run's --out folder")
    rep.add_argument("b", type=Path, help="the second run's --out folder")
    rep.add_argument("--json", action="store_true", help="one JSON object per figure")
    rep.set_defaults(func=_bench_simulator_repeat)


def _add_router(kinds: argparse._SubParsersAction) -> None:
    rt = kinds.add_parser(
        "router", help="latency and CPU the router adds, vs the worker addressed directly",
        description="Starts `pdserve up --collocated 1` (worker pinned to one core) and sends "
                    "the same streamed completions to the worker's own endpoint and through "
                    "the router (at one stream alternating, at c streams c of each at once, "
                    "in the same engine steps): added P50 latency per request (the median "
                    "difference of request pairs), and router CPU per relayed token against "
                    "the decode step time, at each concurrency; and what an API key and a "
                    "rate limit cost: a second router with both, on the same worker, against "
                    "the plain one's CPU per token. Medians of --repeats runs; run it on an "
                    "idle machine.")
    rt.add_argument("--model", default="smollm2", help="default: %(default)s")
    add_device_arg(rt)
    rt.add_argument("--concurrency", default="1,64",
                    help="concurrent streams (default: %(default)s)")
    rt.add_argument("--requests", type=int, default=64,
                    help="requests per run (default: %(default)s; at more than one stream at "
                         "least 8 per stream)")
    rt.add_argument("--max-tokens", type=int, default=16, help="default: %(default)s")
    rt.add_argument("--repeats", type=int, default=3, help="default: %(default)s")
    rt.add_argument("--json", action="store_true", help="one JSON object per level")
    rt.set_defaults(func=_bench_router)


def _add_hostile(kinds: argparse._SubParsersAction) -> None:
    h = kinds.add_parser(
        "hostile", help="how much one huge request delays every other stream's next token",
        description="Starts `pdserve up`, streams long completions through the router on "
                    "--streams connections, and every few seconds sends one completion whose "
                    "JSON body is --body-mb MiB. Prints the P99 gap between a stream's tokens "
                    "while such a request is in flight, against the P99 gap of the same "
                    "streams away from it (the baseline, in the same run). Medians of "
                    "--repeats runs, each a fresh `pdserve up`.")
    h.add_argument("--model", default="smollm2", help="default: %(default)s")
    h.add_argument("--streams", type=int, default=8, help="default: %(default)s")
    h.add_argument("--body-mb", type=float, default=10.0,
                   help="size of the hostile body in MiB (default: %(default)s)")
    h.add_argument("--kind", choices=("text", "ids"), default="text",
                   help="the hostile prompt: one long text, or a list of token ids (the "
                        "costliest JSON to parse per byte) (default: %(default)s)")
    h.add_argument("--rounds", type=int, default=5,
                   help="hostile requests per run (default: %(default)s)")
    h.add_argument("--repeats", type=int, default=3, help="default: %(default)s")
    h.add_argument("--up-args", nargs=argparse.REMAINDER, default=[],
                   help="the rest of the line goes to `pdserve up` (default: its defaults)")
    h.add_argument("--json", action="store_true", help="medians and every run as JSON")
    h.set_defaults(func=_bench_hostile)


def _add_chaos(kinds: argparse._SubParsersAction) -> None:
    chaos = kinds.add_parser(
        "chaos", help="a cluster under streaming load while workers are killed, stopped and "
                      "attacked: hung requests, leaked KV blocks, clean errors",
        description=CHAOS_DESCRIPTION)
    add_chaos_args(chaos)
    chaos.set_defaults(func=run_chaos_cli)


def _add_flip(kinds: argparse._SubParsersAction) -> None:
    flip = kinds.add_parser(
        "flip", help="live role flips under a streaming load: flip seconds, failed requests, "
                     "outputs changed, KV blocks leaked",
        description=FLIP_DESCRIPTION)
    add_flip_args(flip)
    flip.set_defaults(func=run_flip_cli)


def _bench_attention(args: argparse.Namespace) -> int:
    from pdserve.bench.attention_bench import AttentionSettings, main

    try:
        heads, kv_heads, head_dim = (int(x) for x in args.shape.split(","))
        lengths = tuple(int(n) for n in args.prompt_lens.split(","))
    except ValueError:
        raise ValueError("--shape takes three integers (heads,kv_heads,head_dim) and "
                         "--prompt-lens a comma-separated list of integers") from None
    return main(AttentionSettings(lengths, args.cached, heads, kv_heads, head_dim,
                                  args.repeats, args.kernel), args.json)


def _bench_sampler(args: argparse.Namespace) -> int:
    from pdserve.bench.sampler_bench import SamplerSettings, main

    try:
        batches = tuple(int(n) for n in args.batches.split(","))
    except ValueError:
        raise ValueError("--batches takes comma-separated integers") from None
    return main(SamplerSettings(batches, args.vocab, args.scale, args.repeats, args.rounds),
                args.json)


def _bench_linear(args: argparse.Namespace) -> int:
    from pdserve.bench.linear_bench import LinearSettings, main

    try:
        shape = tuple(int(x) for x in args.shape.split(","))
        rows = tuple(int(n) for n in args.rows.split(","))
    except ValueError:
        raise ValueError("--shape and --rows take comma-separated integers") from None
    if len(shape) != 5:
        raise ValueError("--shape takes five integers: hidden,intermediate,heads,kv_heads,"
                         "head_dim")
    return main(LinearSettings(rows, *shape, repeats=args.repeats, rounds=args.rounds),
                args.json)


def _bench_decode_attention(args: argparse.Namespace) -> int:
    from pdserve.bench.decode_attention_bench import DecodeAttentionSettings, main

    try:
        heads, kv_heads, head_dim = (int(x) for x in args.shape.split(","))
        batches = tuple(int(b) for b in args.batches.split(","))
        contexts = tuple(int(n) for n in args.contexts.split(","))
    except ValueError:
        raise ValueError("--shape takes three integers (heads,kv_heads,head_dim), --batches "
                         "and --contexts comma-separated lists of integers") from None
    return main(DecodeAttentionSettings(heads, kv_heads, head_dim, batches, contexts,
                                        args.repeats), args.json)


def _add_decode_context(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "decode-context", help="what one context token costs a decode step, alone and shared",
        description="Decode steps of B streams with short prompts, with long unique ones, and "
                    "with long ones sharing a prefix, timed in the engine alone: the cost of "
                    "one context token (for `pdserve simulate --decode-context-us`) and what "
                    "a shared prefix's token costs against a unique one. Medians of --repeats "
                    "runs, the short batch the baseline of the same run.")
    p.add_argument("--model", default="smollm2", help="default: %(default)s")
    p.add_argument("--batches", default="4,8", help="streams per batch, each >= 2 (default: "
                                                    "%(default)s)")
    p.add_argument("--context", type=int, default=1360,
                   help="tokens per stream of the long batches (default: %(default)s)")
    p.add_argument("--own", type=int, default=352,
                   help="tokens of its own per stream: the short batch's prompt and the "
                        "shared batch's unshared part (default: %(default)s)")
    p.add_argument("--steps", type=int, default=40, help="timed steps per run (default: "
                                                         "%(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="default: %(default)s")
    p.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES), help=DTYPE_HELP)
    p.add_argument("--threads", type=int, default=None,
                   help="the engine's compute threads, as many as the worker to be priced "
                        "has cores (default: PyTorch's, every core)")
    p.add_argument("--json", action="store_true", help="one JSON object per batch")
    p.set_defaults(func=_bench_decode_context)


def _bench_decode_context(args: argparse.Namespace) -> int:
    from pdserve.bench.context_bench import ContextSettings, main

    try:
        batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        raise ValueError("--batches takes a comma-separated list of integers") from None
    return main(ContextSettings(model=args.model, batches=batches, context=args.context,
                                own=args.own, steps=args.steps, repeats=args.repeats,
                                dtype=args.dtype, threads=args.threads), args.json)


def _bench_engine(args: argparse.Namespace) -> int:
    from pdserve.bench.engine_bench import BenchSettings, main

    batches = tuple(int(b) for b in args.batches.split(","))
    return main(BenchSettings(model=args.model, batches=batches, decode_steps=args.decode_steps,
                              prompt_lens=tuple(int(n) for n in args.prompt_lens.split(",")),
                              cached_len=args.cached_len, chunk=args.chunk,
                              repeats=args.repeats, cpu_kernels=args.cpu_kernels,
                              tensor_parallel_size=args.tensor_parallel_size,
                              dtype=args.dtype, device=args.device,
                              enforce_eager=args.enforce_eager), args.json)


def _bench_moe(args: argparse.Namespace) -> int:
    from pdserve.bench.moe_bench import MoeBenchSettings, main
    from pdserve.bench.moe_models import MoeBenchShape

    try:
        models = tuple(args.models.split(","))
        batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        raise ValueError("--batches takes a comma-separated list of integers") from None
    shape = MoeBenchShape(hidden_size=args.hidden, num_experts=args.experts,
                          expert_width=args.expert_width, num_layers=args.layers)
    return main(MoeBenchSettings(models=models, batches=batches, shape=shape,
                                 prompt_len=args.prompt_len, decode_steps=args.decode_steps,
                                 repeats=args.repeats, threads=args.threads), args.json)


def _bench_moe_ops(args: argparse.Namespace) -> int:
    from pdserve.bench.moe_ops_bench import MoeOpsSettings, main

    try:
        batches = tuple(int(b) for b in args.batches.split(","))
        contexts = tuple(int(n) for n in args.contexts.split(","))
    except ValueError:
        raise ValueError("--batches and --contexts take comma-separated lists of integers"
                         ) from None
    return main(MoeOpsSettings(args.hidden, args.heads, args.kv_lora_rank, batches, contexts,
                               args.experts, args.qwen3_experts, args.repeats), args.json)


def _bench_transfer(args: argparse.Namespace) -> int:
    if args.testbed and args.device != "cpu":
        raise ValueError("--testbed moves host memory between network namespaces: no --device")
    if args.testbed:
        from pdserve.bench import link_bench
        from pdserve.testbed.topology import LinkShape

        base = LinkShape(delay_ms=args.delay_ms, loss_pct=args.loss_pct)
        return link_bench.main([float(g) for g in args.link_gbps.split(",")], base,
                               [int(n) for n in args.concurrent.split(",")], args.repeats,
                               args.json, [int(k) for k in args.senders.split(",")],
                               args.congestion)
    from pdserve.bench.transfer_bench import main

    return main([int(m) for m in args.sizes.split(",")], args.repeats, args.json, args.device)


def _bench_simulator_repeat(args: argparse.Namespace) -> int:
    from pdserve.bench.simulator_repeat import run_simulator_repeat_cli

    return run_simulator_repeat_cli(args)


def _bench_layerwise(args: argparse.Namespace) -> int:
    from pdserve.bench.layerwise_bench import main

    return main(args.model, args.transport, args.prompt_tokens, args.repeats, args.json,
                args.device)


def _bench_router(args: argparse.Namespace) -> int:
    from pdserve.bench.router_bench import RouterBenchSettings, main

    levels = tuple(int(c) for c in args.concurrency.split(","))
    return main(RouterBenchSettings(model=args.model, device=args.device, concurrency=levels,
                                    requests=args.requests, max_tokens=args.max_tokens,
                                    repeats=args.repeats), args.json)


def _bench_hostile(args: argparse.Namespace) -> int:
    from pdserve.bench.hostile_bench import HostileBenchSettings, main

    return main(HostileBenchSettings(model=args.model, streams=args.streams,
                                     body_mb=args.body_mb, kind=args.kind, rounds=args.rounds,
                                     repeats=args.repeats, up_args=tuple(args.up_args)),
                args.json)
