"""`POST /internal/role`: change a worker's role live (`workers/role_flip.py` runs the change).
Signed like every `/internal/` path (`workers/access.py`: 401 without a valid signature).

Body: `{"role": "prefill" | "decode" | "collocated", "timeout_s": <seconds the drain may
take, default 30>, "reason": <optional text for the worker's log>}`; other keys are refused.
Answers, each with the worker's proof of the secret (`X-Pdserve-Proof`), errors OpenAI-shaped:
- 200 `{"from", "to", "seconds"}`: the worker serves in the new role; `seconds` from the
  command to then (the drain included).
- 400: not a JSON object, an unknown role or key, a bad timeout.
- 409: the role it has already (`same_role`), a change under way (`flip_in_progress`), a role
  it cannot take (`role_unavailable`: no KV transfer endpoint).
- 503 `drain_timeout`: what it held outlasted `timeout_s`; the role is unchanged and the worker
  takes legs again.
A client that leaves before the answer does not stop the change.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve.api.errors import ApiError, bad_request
from pdserve.common.engine_options import Role
from pdserve.workers.access import WorkerAccess
from pdserve.workers.engine_loop import EngineLoop

log = logging.getLogger("pdserve.worker")

DEFAULT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 3600.0
MAX_REASON_CHARS = 500
ROLES = ", ".join(r.value for r in Role)


@dataclass(frozen=True)
class RoleChange:
    role: Role
    timeout_s: float = DEFAULT_TIMEOUT_S
    reason: str | None = None

    @classmethod
    def from_json(cls, body: Any) -> RoleChange:
        """ApiError (400) naming the field that is wrong."""
        if not isinstance(body, dict):
            raise bad_request(f'the body must be a JSON object like {{"role": "decode"}}; '
                              f"roles: {ROLES}")
        unknown = sorted(set(body) - {"role", "timeout_s", "reason"})
        if unknown:
            raise bad_request(f"unknown key(s) {unknown}; give role, and optionally timeout_s "
                              f"and reason", unknown[0])
        role = body.get("role")
        if role not in tuple(Role):
            raise bad_request(f"role must be one of {ROLES}; got {role!r}", "role")
        timeout = body.get("timeout_s", DEFAULT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or \
                not math.isfinite(timeout) or not 0 < timeout <= MAX_TIMEOUT_S:
            raise bad_request(f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]"
                              f"; got {timeout!r}", "timeout_s")
        reason = body.get("reason")
        if reason is not None and (not isinstance(reason, str) or
                                   len(reason) > MAX_REASON_CHARS):
            raise bad_request(f"reason must be a string of at most {MAX_REASON_CHARS} "
                              f"characters", "reason")
        return cls(Role(role), float(timeout), reason)


async def change_role(request: web.Request, loop: EngineLoop,
                      access: WorkerAccess) -> web.Response:
    """The handler; the access middleware let only signed requests in."""
    try:
        change = RoleChange.from_json(await read_json(request))
    except ApiError as e:
        return access.signed_json(request, e.body(), e.status)
    log.info("role change to %s asked by %s (drain up to %g s)%s", change.role.value,
             request.remote or "?", change.timeout_s,
             f": {change.reason}" if change.reason else "")
    result = await loop.change_role(change.role, change.timeout_s)
    if isinstance(result, ApiError):
        return access.signed_json(request, result.body(), result.status)
    return access.signed_json(request, result.body())


async def read_json(request: web.Request) -> Any:
    """The request's JSON body; ApiError (400) when it is not JSON."""
    try:
        return json.loads(await request.read())
    except ValueError as e:  # not JSON, or not UTF-8
        raise bad_request(f"the body is not JSON ({e})") from e
