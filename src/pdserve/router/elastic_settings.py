"""The router's elastic-pool options (`--elastic`, `--slo-ttft-ms`; the TPOT target is the
router's `--slo-tpot-ms`, which the split decision uses too). One frozen `ElasticSettings`
per router when `--elastic` is given, None otherwise; `elastic_to_args` writes them back for
`pdserve up`.

Invariants: every duration is a finite number of seconds > 0, `sustain_ticks` an int >= 1.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

DEFAULT_INTERVAL_S = 2.0  # two health rounds (1 s apart) per observation: each sees new data
DEFAULT_SLO_TTFT_MS = 2000.0
# Pressure must be seen this many ticks in a row before a flip: 3 ticks of 2 s span six health
# reports, so a burst the queues absorb in a few seconds never flips anyone; a trend does.
DEFAULT_SUSTAIN_TICKS = 3
# After every flip (done, refused or failed) the pools are left alone this long: the flipped
# worker first drains its legs, the rates in /health are medians over the last 64 steps, and
# the queues rebalance; judging sooner would act on the old configuration's numbers.
DEFAULT_COOLDOWN_S = 30.0


@dataclass(frozen=True)
class ElasticSettings:
    ttft_target_s: float = DEFAULT_SLO_TTFT_MS / 1000.0
    tpot_target_s: float = 0.1
    interval_s: float = DEFAULT_INTERVAL_S
    sustain_ticks: int = DEFAULT_SUSTAIN_TICKS
    cooldown_s: float = DEFAULT_COOLDOWN_S

    def __post_init__(self) -> None:
        for name, flag in (("ttft_target_s", "--slo-ttft-ms"), ("tpot_target_s", "--slo-tpot-ms"),
                           ("interval_s", "interval_s"), ("cooldown_s", "cooldown_s")):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{flag} must be a number > 0, got {value!r}")
        ticks = self.sustain_ticks
        if not (isinstance(ticks, int) and not isinstance(ticks, bool) and ticks >= 1):
            raise ValueError(f"sustain_ticks must be an integer >= 1, got {ticks!r}")


def add_elastic_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("elastic pools (live role flips steered by the router)")
    g.add_argument("--elastic", action="store_true",
                   help="the router watches the prefill and decode pools and flips workers "
                        "between the two roles when one side stays under pressure and the "
                        "other has room (at most one flip per cool-down; at least one worker "
                        "of each role is kept while there is work for it)")
    g.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_SLO_TTFT_MS, metavar="MS",
                   help="time to first token to keep, with --elastic: a decode worker becomes a "
                        "prefill worker when the expected wait for a prefill stays above half "
                        "of this (default: %(default)s)")


def elastic_from_args(args: argparse.Namespace) -> ElasticSettings | None:
    """None without --elastic; ValueError for a bad target, naming the flag."""
    if not args.elastic:
        return None
    return ElasticSettings(ttft_target_s=args.slo_ttft_ms / 1000.0,
                           tpot_target_s=args.slo_tpot_ms / 1000.0)


def elastic_to_args(elastic: bool, slo_ttft_s: float) -> list[str]:
    """The router flags for these `pdserve up` options (none at their defaults)."""
    argv = ["--elastic"] if elastic else []
    if slo_ttft_s != DEFAULT_SLO_TTFT_MS / 1000.0:
        argv += ["--slo-ttft-ms", f"{slo_ttft_s * 1000:g}"]
    return argv
