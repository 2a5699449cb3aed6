"""A split layout's paths, measured against simulated, request by request.

The measured path of a request is what pdserve's router told the client (bench serve keeps the
response's `X-Pdserve-Route` header: "local; rule=..." or "disaggregated; rule=..."), the
simulated one what the simulation's router chose for the same request (routing.py); requests
are matched by their place in the trace, which both sides replay in the same order. The
totals of local prefills can agree while the decisions do not (a few kept local on one side,
as many others on the other); these counts say which prompts the two routers disagree on.

A request counts only where both sides know its path: not one refused before the router
chose (no header), not one the simulation refused at admission.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.planner.simulate.metrics import RequestRecord

# the route header's first word -> local (True) or split (False)
_PATHS = {"local": True, "disaggregated": False}


def route_is_local(route: object) -> bool | None:
    """A route header's path: True for "local; ...", False for "disaggregated; ...", None for
    anything else (no header: another server, or the request refused before its path)."""
    if not isinstance(route, str):
        return None
    return _PATHS.get(route.split(";", 1)[0].strip())


@dataclass(frozen=True)
class PathAgreement:
    """`same`: requests on the same path in both; the other two hold the prompt tokens of each
    request that took one path measured and the other simulated."""

    same: int
    local_measured_only: tuple[int, ...]  # measured local, simulated split
    local_simulated_only: tuple[int, ...]  # measured split, simulated local

    @property
    def compared(self) -> int:
        return self.same + len(self.local_measured_only) + len(self.local_simulated_only)

    def describe(self) -> str:
        """"55 of 60 requests on the same path; local measured, split simulated: 3 (prompts of
        240-610 tokens); split measured, local simulated: 2 (...)"."""
        return (f"{self.same} of {self.compared} requests on the same path; local measured, "
                f"split simulated: {_sizes(self.local_measured_only)}; split measured, local "
                f"simulated: {_sizes(self.local_simulated_only)}")

    def to_json(self) -> dict[str, Any]:
        return {"same": self.same, "compared": self.compared,
                "local_measured_only": list(self.local_measured_only),
                "local_simulated_only": list(self.local_simulated_only)}


def _sizes(prompts: tuple[int, ...]) -> str:
    if not prompts:
        return "0"
    low, high = min(prompts), max(prompts)
    span = f"{low}" if low == high else f"{low}-{high}"
    return f"{len(prompts)} (prompts of {span} tokens)"


def agreement(measured: Sequence[bool | None], simulated: Sequence[RequestRecord]
              ) -> PathAgreement | None:
    """`measured`: each trace request's measured path (True local, None unknown), in trace
    order; `simulated`: the simulation's records of the same trace. None when the two are not
    the same trace's or no request has a path on both sides."""
    if len(measured) != len(simulated):
        return None
    same, measured_only, simulated_only = 0, [], []
    for local, record in zip(measured, simulated, strict=True):
        if local is None or record.local is None:
            continue
        if local == record.local:
            same += 1
        else:
            (measured_only if local else simulated_only).append(record.prompt_tokens)
    if not (same or measured_only or simulated_only):
        return None
    return PathAgreement(same, tuple(measured_only), tuple(simulated_only))
