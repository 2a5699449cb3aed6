"""The options of `pdserve bench flip` and the settings they make. Torch-free: `pdserve bench
flip --help` loads only this."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.bench.chaos.cli import HUNG_GRACE_S, ChaosSettings

GOAL_MEDIAN_S = 1.0  # the flip goals: median and worst reply seconds, strictly under
GOAL_WORST_S = 2.5


@dataclass(frozen=True)
class FlipSettings:
    """One run: `flips` flips of one decode worker (decode -> prefill -> decode ...) while
    `streams` clients send the `prompts` fixed prompts again and again."""

    model: str = "smollm2"
    prefill: int = 1
    decode: int = 2
    streams: int = 16
    flips: int = 20
    max_tokens: int = 64
    prompt_tokens: int = 300
    prompts: int = 64
    pause_s: float = 1.0
    settle_s: float = 40.0  # pdserve up's default --kv-lease + 10
    hung_after_s: float = ChaosSettings().leg_timeout_s + HUNG_GRACE_S
    seed: int = 0
    up_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.flips < 0:
            raise ValueError(f"--flips must be >= 0, got {self.flips}")
        for name in ("prefill", "decode", "streams", "max_tokens", "prompt_tokens", "prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if not self.pause_s >= 0:
            raise ValueError(f"--pause must be >= 0 seconds, got {self.pause_s}")
        for name in ("settle_s", "hung_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name[:-2].replace('_', '-')} must be > 0 seconds, got "
                                 f"{getattr(self, name)}")

    def up_argv(self) -> tuple[str, ...]:
        """`pdserve up`'s options, beside --model, the port and the secret file that UpProcess
        gives."""
        return ("--prefill", str(self.prefill), "--decode", str(self.decode), *self.up_args)

    def to_json(self) -> dict[str, object]:
        return {"model": self.model, "streams": self.streams, "flips": self.flips,
                "max_tokens": self.max_tokens, "prompt_tokens": self.prompt_tokens,
                "prompts": self.prompts, "pause_s": self.pause_s, "settle_s": self.settle_s,
                "hung_after_s": self.hung_after_s, "seed": self.seed,
                "up_args": list(self.up_argv())}


DESCRIPTION = (
    "Starts `pdserve up` with a cluster secret, sends each of --prompts fixed prompts once "
    "without flips (greedy, ignore_eos) to get its reference output, then runs --streams "
    "concurrent streaming clients that send those prompts again and again while one decode "
    "worker is flipped decode -> prefill -> decode ... --flips times through the router's "
    "signed flip endpoint (the call `pdserve ctl flip` makes), each flip awaited, then --pause "
    "seconds before the next; a refusal (409: the flip would leave no worker of a role for "
    "the requests) is reported and the next flip tried. Reports per flip the router's reply "
    "seconds (flip command to the worker serving in its new role and the router routing to "
    "it) and first_step_s: from the flip command to the end of the first engine step the "
    "worker ran in its new role, read from its step trace at the end of the pause (null when "
    "it ran none within the pause: e.g. no prompt was split while it was a prefill worker); "
    "then the median and worst reply seconds against the goals (median < "
    f"{GOAL_MEDIAN_S:g} s, worst < {GOAL_WORST_S:g} s), requests ok and failed, outputs that "
    "differ from the reference, and the KV blocks every worker still holds once idle. Prints "
    "one JSON object with --json, else a summary and the JSON; a progress line per flip on "
    "stderr. Exit status 1 when a request failed, an output differed, a block leaked, a "
    "worker did not answer or a flip failed (a refusal is not a failure); the timing goals "
    "are reported, not enforced.")


def add_flip_args(p: argparse.ArgumentParser) -> None:
    d = FlipSettings()
    p.add_argument("--model", default=d.model, help="default: %(default)s")
    p.add_argument("--streams", type=int, default=d.streams, metavar="N",
                   help="concurrent streaming clients during the flips (default: %(default)s)")
    p.add_argument("--flips", type=int, default=d.flips, metavar="N",
                   help="flips of the flipped worker, alternately to prefill and back to "
                        "decode; 0 with a long --pause is the control: the same load for "
                        "that long without a flip (default: %(default)s)")
    p.add_argument("--pause", type=float, default=d.pause_s, metavar="S",
                   help="seconds under load before the first flip and after each flip's "
                        "reply; the worker's first step in its new role is looked for within "
                        "it (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, metavar="N",
                   help="tokens every request asks for, with ignore_eos (default: "
                        "%(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, metavar="N",
                   help="token ids in every prompt (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=d.prompts, metavar="N",
                   help="distinct fixed prompts; client i sends prompts i, i + streams, ... "
                        "round the set (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="the prompts' token ids (default: %(default)s)")
    p.add_argument("--settle", type=float, default=d.settle_s, metavar="S",
                   help="longest wait, after the load, for every worker to hold no KV block "
                        "(default: %(default)s)")
    p.add_argument("--hung-after", type=float, default=d.hung_after_s, metavar="S",
                   help="a request that gets no byte for this long is cut off and fails "
                        "(default: %(default)s)")
    g = p.add_argument_group("the cluster (passed to pdserve up)")
    g.add_argument("--prefill", type=int, default=d.prefill, metavar="N",
                   help="prefill workers (default: %(default)s)")
    g.add_argument("--decode", type=int, default=d.decode, metavar="N",
                   help="decode workers; the first one is flipped, so with 1 the router "
                        "refuses flips to prefill while requests are in flight (default: "
                        "%(default)s)")
    g.add_argument("--up-args", nargs=argparse.REMAINDER, default=[],
                   help="the rest of the line goes to `pdserve up`, e.g. --dtype float32 "
                        "--local-prefill-threshold 64")
    p.add_argument("--json", action="store_true", help="print only the JSON object")


def settings_from_args(args: argparse.Namespace) -> FlipSettings:
    return FlipSettings(
        model=args.model, prefill=args.prefill, decode=args.decode, streams=args.streams,
        flips=args.flips, max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens,
        prompts=args.prompts, pause_s=args.pause, settle_s=args.settle,
        hung_after_s=args.hung_after, seed=args.seed, up_args=tuple(args.up_args))


def run_flip_cli(args: argparse.Namespace) -> int:
    from pdserve.bench.flip.run import main

    return main(settings_from_args(args), args.json)
