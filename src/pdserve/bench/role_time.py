"""Where each worker's time went during a measured run, by role, from the roles its
`GET /internal/steps?since=START` returned: spans {"role", "since", "from", "flip_seconds"},
oldest first, the first one in force at START (`workers/role_history.py`).

A worker is in a role from its span's `since` to the next span's; a flip's drain (the
`flip_seconds` before a span's `since`) counts to the role being left, which the worker kept
until the flip completed. Every function takes wall-clock seconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Span = Mapping[str, Any]


def _segments(roles: Sequence[Span], start: float) -> list[tuple[str, float]]:
    """(role, from when), oldest first; a history whose oldest kept span began after `start`
    (older ones dropped) is led by that span's "from" role, in force since `start`."""
    head = [(roles[0]["from"], start)] if roles and roles[0]["since"] > start and \
        roles[0]["from"] is not None else []
    return head + [(span["role"], span["since"]) for span in roles]


def role_seconds(roles: Sequence[Span], start: float, end: float) -> dict[str, float]:
    """Seconds in each role within [start, end], roles in order of first appearance there
    (roles held for no time there are left out). They sum to end - start whenever the history
    covers `start` (always, but for a worker that started during the run)."""
    if end < start:
        raise ValueError(f"the run ends ({end}) before it starts ({start})")
    segments = _segments(roles, start)
    seconds: dict[str, float] = {}
    for (role, begin), (_, finish) in zip(segments, [*segments[1:], (None, end)], strict=True):
        held = min(finish, end) - max(begin, start)
        if held > 0:
            seconds[role] = seconds.get(role, 0.0) + held
    return seconds


def role_at(roles: Sequence[Span], t: float) -> str:
    """The role in force at `t` (the oldest known one when `t` is before every span)."""
    segments = _segments(roles, t)
    if not segments:
        raise ValueError("no roles: a worker always has one")
    return next((role for role, since in reversed(segments) if since <= t), segments[0][0])


def flips_within(roles: Sequence[Span], start: float, end: float) -> list[Span]:
    """The role changes that completed within (start, end], oldest first."""
    return [span for span in roles if span["from"] is not None and start < span["since"] <= end]


def format_role_seconds(workers: Mapping[str, Mapping[str, float]]) -> str:
    """'prefill-0: prefill 96 s, decode 84 s; decode-0: decode 180 s' (whole seconds)."""
    return "; ".join(f"{name}: " + ", ".join(f"{role} {s:.0f} s" for role, s in by_role.items())
                     for name, by_role in workers.items())
