"""The options of `pdserve bench chaos` and the settings they make. Torch-free: `pdserve bench
chaos --help` loads only this and `schedule`.

The cluster options that the bench must know (the leg timeout bounds a request's silence, the
lease bounds how long blocks may stay held, the body limit sizes the oversized body) are its
own options, passed on to `pdserve up`; anything else goes through `--up-args`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.bench.chaos.schedule import FAULT_HELP, FAULT_KINDS, parse_faults, schedule
from pdserve.cli_args import parse_size

HUNG_GRACE_S = 5.0  # over the leg timeout: the router's own check runs every second or so
SETTLE_GRACE_S = 10.0  # over the lease: what a stalled worker held comes back within it


@dataclass(frozen=True)
class ChaosSettings:
    """One run. `hung_after_s` None: the leg timeout + HUNG_GRACE_S; `settle_s` None: the
    KV lease + SETTLE_GRACE_S."""

    model: str = "smollm2"
    duration_s: float = 120.0
    streams: int = 12
    faults: tuple[str, ...] = FAULT_KINDS
    max_tokens: int = 32
    seed: int = 0
    prefill: int = 1
    decode: int = 1
    transport: str = "tcp"
    kv_lease_s: float = 30.0
    leg_timeout_s: float = 60.0
    max_body_size: str = "16MiB"
    hung_after: float | None = None
    settle: float | None = None
    up_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("streams", "prefill", "decode"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens < 8:
            raise ValueError(f"--max-tokens must be >= 8, got {self.max_tokens}")
        for name in ("duration_s", "kv_lease_s", "leg_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        for name in ("hung_after", "settle"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds")
        parse_size(self.max_body_size)
        schedule(self.faults, self.duration_s)  # ValueError when the run is too short

    @property
    def hung_after_s(self) -> float:
        return self.hung_after if self.hung_after is not None else \
            self.leg_timeout_s + HUNG_GRACE_S

    @property
    def settle_s(self) -> float:
        return self.settle if self.settle is not None else self.kv_lease_s + SETTLE_GRACE_S

    @property
    def body_limit(self) -> int:
        return parse_size(self.max_body_size)

    def up_argv(self) -> tuple[str, ...]:
        """`pdserve up`'s options, beside --model and the port that UpProcess gives."""
        return ("--prefill", str(self.prefill), "--decode", str(self.decode),
                "--transport", self.transport, "--kv-lease", repr(self.kv_lease_s),
                "--leg-timeout", repr(self.leg_timeout_s), "--max-body-size",
                self.max_body_size, *self.up_args)

    def to_json(self) -> dict[str, object]:
        return {"model": self.model, "duration_s": self.duration_s, "streams": self.streams,
                "faults": list(self.faults), "max_tokens": self.max_tokens, "seed": self.seed,
                "hung_after_s": self.hung_after_s, "settle_s": self.settle_s,
                "up_args": list(self.up_argv())}


DESCRIPTION = (
    "Starts `pdserve up` (1 prefill + 1 decode worker unless told otherwise), runs --streams "
    "closed-loop clients that stream completions and chat completions (short prompts run on "
    "the decode worker, medium and long ones are split into prefill and decode) for "
    "--duration seconds, and injects faults on a schedule spread over the run (none in its "
    "first 10% or last 25%; every selected kind once a round, as many rounds as fit 4 s "
    "apart, at most 4). Then it waits until the workers hold no KV block (at most --settle "
    "seconds), checks that the cluster still serves, and stops it (also on Ctrl-C or an "
    "error). Prints one JSON object with --json, else a summary and the JSON. Exit status 1 "
    "when a request hung, a block leaked, a worker did not answer, a fault's outcome was not "
    "what pdserve promises, or the cluster stopped serving.")
FAULTS_HELP = "comma-separated fault kinds, or all (the default): " + "; ".join(
    f"{k}: {v}" for k, v in FAULT_HELP.items())


def add_chaos_args(p: argparse.ArgumentParser) -> None:
    d = ChaosSettings()
    p.add_argument("--duration", type=float, default=d.duration_s, metavar="S",
                   help="seconds of load (default: %(default)s)")
    p.add_argument("--streams", type=int, default=d.streams, metavar="N",
                   help="concurrent streaming clients (default: %(default)s)")
    p.add_argument("--faults", default="all", metavar="LIST",
                   help=FAULTS_HELP)
    p.add_argument("--model", default=d.model, help="default: %(default)s")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="most tokens a request asks for; each asks for 8 up to this "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="the request mix's (default: 0)")
    p.add_argument("--hung-after", type=float, default=None, metavar="S",
                   help="a request that gets no byte for this long is hung and cut off "
                        f"(default: --leg-timeout + {HUNG_GRACE_S:g})")
    p.add_argument("--settle", type=float, default=None, metavar="S",
                   help="longest wait, after the load, for every worker to hold no KV block "
                        f"(default: --kv-lease + {SETTLE_GRACE_S:g})")
    g = p.add_argument_group("the cluster (passed to pdserve up)")
    g.add_argument("--prefill", type=int, default=d.prefill, metavar="N",
                   help="prefill workers (default: %(default)s)")
    g.add_argument("--decode", type=int, default=d.decode, metavar="N",
                   help="decode workers (default: %(default)s)")
    g.add_argument("--transport", choices=("tcp", "nixl"), default=d.transport,
                   help="KV transport (default: %(default)s)")
    g.add_argument("--kv-lease", type=float, default=d.kv_lease_s, metavar="S",
                   help="pdserve up's --kv-lease; sets the default --settle "
                        "(default: %(default)s)")
    g.add_argument("--leg-timeout", type=float, default=d.leg_timeout_s, metavar="S",
                   help="pdserve up's --leg-timeout; sets the default --hung-after "
                        "(default: %(default)s)")
    g.add_argument("--max-body-size", default=d.max_body_size, metavar="SIZE",
                   help="the router's body limit; the oversized body is 1 MiB over it "
                        "(default: %(default)s)")
    g.add_argument("--up-args", nargs=argparse.REMAINDER, default=[],
                   help="the rest of the line goes to `pdserve up`, e.g. --dtype float32 "
                        "--cpus 0,1")
    p.add_argument("--json", action="store_true", help="print only the JSON object")


def settings_from_args(args: argparse.Namespace) -> ChaosSettings:
    return ChaosSettings(
        model=args.model, duration_s=args.duration, streams=args.streams,
        faults=parse_faults(args.faults), max_tokens=args.max_tokens, seed=args.seed,
        prefill=args.prefill, decode=args.decode, transport=args.transport,
        kv_lease_s=args.kv_lease, leg_timeout_s=args.leg_timeout,
        max_body_size=args.max_body_size, hung_after=args.hung_after, settle=args.settle,
        up_args=tuple(args.up_args))


def run_chaos_cli(args: argparse.Namespace) -> int:
    from pdserve.bench.chaos.run import main

    return main(settings_from_args(args), args.json)
