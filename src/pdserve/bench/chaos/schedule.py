"""The fault kinds of `pdserve bench chaos` and when each is injected over a run.

Invariants of `schedule`:
- No fault falls in the first WARMUP_FRACTION of the run (the load reaches its steady state)
  nor in the last RECOVERY_FRACTION (the last fault's effects play out under load).
- The faults come in rounds: each round injects every selected kind once, in FAULT_KINDS order
  (disruptive and light kinds alternate; the SIGKILL of the decode worker, which the router's
  every request needs, ends a round, so the faults after it in a round do not wait on its
  restart, and the two SIGKILLs are a round's length apart). As many
  rounds as leave MIN_GAP_S between faults, at least one, at most MAX_ROUNDS: a killed worker
  is restarted by `pdserve up` at most 5 times in 300 s, and one run kills each worker at most
  once a round.
- Faults are evenly spaced: fault i of n is at start + (i + 0.5) * window / n.
A run too short for one round with MIN_GAP_S between its faults is refused (ValueError).
"""

from __future__ import annotations

from dataclasses import dataclass

FAULT_KINDS = ("kill9-prefill", "client-gone-prefill", "oversized-body", "stop-cont",
               "client-gone-transfer", "corrupt-kv", "client-gone-stream", "kill9-decode")
FAULT_HELP = {
    "kill9-prefill": "SIGKILL a prefill worker (pdserve up restarts it)",
    "kill9-decode": "SIGKILL a decode worker (pdserve up restarts it)",
    "stop-cont": "SIGSTOP a worker (decode and prefill in turn) for a few seconds, then SIGCONT",
    "client-gone-prefill": "a client closes its connection while its long prompt prefills",
    "client-gone-transfer": "a client closes right after the first token of a long (split) "
                            "prompt, while its KV moves to the decode worker",
    "client-gone-stream": "a client closes after a few tokens, mid-decode",
    "corrupt-kv": "a forged HELLO and a WRITE without handshake at a worker's KV port (must be "
                  "refused)",
    "oversized-body": "a body over the router's --max-body-size (must be answered 413)",
}
WARMUP_FRACTION = 0.1
RECOVERY_FRACTION = 0.25
MIN_GAP_S = 4.0
MAX_ROUNDS = 4


@dataclass(frozen=True)
class ScheduledFault:
    """One fault to inject `at_s` seconds after the load started."""

    kind: str
    at_s: float


def parse_faults(text: str) -> tuple[str, ...]:
    """'kill9-decode,oversized-body' -> the kinds in FAULT_KINDS order, duplicates dropped;
    'all' (or an empty list) -> every kind. ValueError naming an unknown kind and the choices."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or names == ["all"]:
        return FAULT_KINDS
    unknown = [n for n in names if n not in FAULT_KINDS]
    if unknown:
        raise ValueError(f"unknown fault {', '.join(map(repr, unknown))} in --faults; choose "
                         f"from {', '.join(FAULT_KINDS)} (or all)")
    return tuple(k for k in FAULT_KINDS if k in names)


def schedule(kinds: tuple[str, ...], duration_s: float) -> list[ScheduledFault]:
    """The faults of a run of `duration_s` seconds (see the module docstring), by time."""
    if not kinds:
        return []
    start = WARMUP_FRACTION * duration_s
    window = (1 - WARMUP_FRACTION - RECOVERY_FRACTION) * duration_s
    rounds = min(MAX_ROUNDS, int(window // (len(kinds) * MIN_GAP_S)))
    if rounds < 1:
        shortest = len(kinds) * MIN_GAP_S / (1 - WARMUP_FRACTION - RECOVERY_FRACTION)
        raise ValueError(f"--duration {duration_s:g} s is too short for {len(kinds)} fault "
                         f"kinds {MIN_GAP_S:g} s apart: give at least {shortest:.0f} s or "
                         "fewer --faults")
    n = rounds * len(kinds)
    return [ScheduledFault(kinds[i % len(kinds)], start + (i + 0.5) * window / n)
            for i in range(n)]
