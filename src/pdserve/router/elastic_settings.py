"""The router's elastic-pool options (`--elastic`, `--slo-ttft-ms`, the controller's timing
`--elastic-interval-s`, `--elastic-sustain-ticks`, `--elastic-cooldown-s`; the TPOT target is
the router's `--slo-tpot-ms`, which the split decision uses too). One frozen `ElasticSettings`
per router when `--elastic` is given, None otherwise (the values are checked either way);
`elastic_to_args` writes them back for `pdserve up`.

Invariants: every duration is a finite number of seconds > 0, `sustain_ticks` an int >= 1.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

# One health round (1 s apart) per observation: each sees new rates. The arrivals the router
# counts itself are current at every tick.
DEFAULT_INTERVAL_S = 1.0
DEFAULT_SLO_TTFT_MS = 2000.0
# Pressure must be seen this many ticks in a row before a flip: 3 ticks of 1 s span three
# health reports, so a burst the queues absorb within seconds never flips anyone; a trend does.
# A flip away from the prefill side also needs the arrival rate measured over a window of at
# least these 3 s that holds 8 prompts (`elastic.py`, `elastic_window.py`), so it can act ~3 s
# after a decode-bound load began without taking a lull between long prompts for idleness.
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
                           ("interval_s", "--elastic-interval-s"),
                           ("cooldown_s", "--elastic-cooldown-s")):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{flag} must be a number > 0, got {value!r}")
        ticks = self.sustain_ticks
        if not (isinstance(ticks, int) and not isinstance(ticks, bool) and ticks >= 1):
            raise ValueError(f"--elastic-sustain-ticks must be an integer >= 1, got {ticks!r}")


def add_elastic_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("elastic pools (live role flips steered by the router)")
    g.add_argument("--elastic", action="store_true",
                   help="the router watches the prefill and decode pools and flips workers "
                        "between the two roles when one side stays under pressure and the "
                        "other has room, or lends the last prefill worker's cores to a "
                        "decode worker of the same machine where a flip cannot help, one "
                        "engine on both sets is cheaper, or no prompt has arrived for a minute "
                        "(so a pair on one machine starts as one engine on both; at most one "
                        "change per cool-down; at "
                        "least one worker of each role is kept while there is work for it)")
    g.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_SLO_TTFT_MS, metavar="MS",
                   help="time to first token to keep, with --elastic: a decode worker becomes a "
                        "prefill worker when the expected wait for a prefill stays above half "
                        "of this; with `pdserve up` and --slo-itl-ms, a decode worker's steps "
                        "beside its streams also run to that ceiling while a prompt it "
                        "prefills would miss it otherwise (default: %(default)s)")
    g.add_argument("--elastic-interval-s", type=float, default=DEFAULT_INTERVAL_S,
                   metavar="SECONDS",
                   help="with --elastic: how often the router observes the pools "
                        "(default: %(default)s)")
    g.add_argument("--elastic-sustain-ticks", type=int, default=DEFAULT_SUSTAIN_TICKS,
                   metavar="N",
                   help="with --elastic: observations in a row that must show the same "
                        "pressure before a worker flips (default: %(default)s)")
    g.add_argument("--elastic-cooldown-s", type=float, default=DEFAULT_COOLDOWN_S,
                   metavar="SECONDS",
                   help="with --elastic: how long the pools are left alone after each flip "
                        "attempt, done or not (default: %(default)s)")


def elastic_from_args(args: argparse.Namespace) -> ElasticSettings | None:
    """None without --elastic; ValueError for a bad value, naming the flag, with or without."""
    settings = ElasticSettings(ttft_target_s=args.slo_ttft_ms / 1000.0,
                               tpot_target_s=args.slo_tpot_ms / 1000.0,
                               interval_s=args.elastic_interval_s,
                               sustain_ticks=args.elastic_sustain_ticks,
                               cooldown_s=args.elastic_cooldown_s)
    return settings if args.elastic else None


def elastic_to_args(settings: ElasticSettings | None) -> list[str]:
    """The router flags that give `settings` back through `elastic_from_args` (none for None
    or a default; the TPOT target is the router's --slo-tpot-ms, which the split options
    carry)."""
    if settings is None:
        return []
    argv = ["--elastic"]
    if settings.ttft_target_s != DEFAULT_SLO_TTFT_MS / 1000.0:
        argv += ["--slo-ttft-ms", f"{settings.ttft_target_s * 1000:g}"]
    if settings.interval_s != DEFAULT_INTERVAL_S:
        argv += ["--elastic-interval-s", repr(settings.interval_s)]
    if settings.sustain_ticks != DEFAULT_SUSTAIN_TICKS:
        argv += ["--elastic-sustain-ticks", str(settings.sustain_ticks)]
    if settings.cooldown_s != DEFAULT_COOLDOWN_S:
        argv += ["--elastic-cooldown-s", repr(settings.cooldown_s)]
    return argv
