"""A worker's live role change (prefill, decode, collocated), run on the engine thread: the
process, the model and the KV pool stay; what changes is what the engine does with the legs it
takes from then on (`Engine.set_role`).

Life cycle of a flip (at most one at a time):
1. `POST /internal/role` (signed; `workers/role_endpoint.py`) checks the body and puts a
   `Flip` command on the engine thread's queue, then awaits its one reply.
2. `begin`, on the engine thread: refused at once (409) when the worker has that role already,
   a flip is under way, or the role moves KV and the worker has no transfer endpoint. Else the
   worker is flipping: every leg submitted from now on is refused with `FLIPPING` (a final error
   event: the leg channel answers it as a refusal, the worker's own /v1 with 503), and the
   signed /health says `"state": "flipping"`.
3. Draining: what moves KV finishes first, while every running stream keeps decoding: held
   prefills until their transfers end and their blocks are released, a decode leg waiting for
   its KV until it has it (or recomputes after its lease), a failed reception's blocks until
   its writer is quiet. A worker becoming a prefill worker does not wait for the prefills its
   reservations wait for (queued behind others on a busy prefill worker, they may not have
   started): the router's decode legs whose KV has not come are handed back at once, their
   transfers given up (`HandOver.hand_back`), so the flip waits only until no writer can
   touch their blocks (a round trip). `advance`, after every iteration of the engine loop, is
   told whether anything still holds the flip.
4. Then, in one iteration of the engine loop (`EngineLoop._advance_flip`): running streams
   go on in a decode or collocated role; a worker becoming a prefill worker hands the router's
   running legs back, their KV parked (the router continues each on a decode worker, the KV
   sent from here as it is: `router/dispatch.py`, `workers/parked.py`), while a client's own
   /v1 request, which no router can continue, holds the flip until it ends. `Engine.set_role`;
   the reply is `FlipDone` (200: from, to, seconds from the command to now) and the worker
   serves in its new role.
5. The deadline (`timeout_s` after the command) comes first: the reply is 503, the role is
   unchanged and legs are taken again.

Invariants: the role changes only on the engine thread and only while no request moves KV in
or out, so a hand-over or reservation ends in the role that began it; a running stream either
goes on or is handed back whole (the router has every token it produced); every `Flip` gets
exactly one reply. Threading: the engine thread alone calls `begin` and `advance`; the HTTP
thread only reads `state`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.api.errors import SERVER_ERROR, ApiError
from pdserve.common.engine_options import Role
from pdserve.engine.engine import Engine
from pdserve.workers.loop_commands import Flip, Sink
from pdserve.workers.role_history import RoleHistory
from pdserve.workers.worker_metrics import WorkerMetrics

log = logging.getLogger("pdserve.worker")

FLIPPING = "this worker is changing role"
SERVING, DRAINING = "serving", "flipping"


@dataclass(frozen=True)
class FlipDone:
    """The worker serves in `to` now; `seconds` from the command to that moment."""

    from_role: Role
    to_role: Role
    seconds: float

    def body(self) -> dict[str, Any]:
        return {"from": self.from_role.value, "to": self.to_role.value, "seconds": self.seconds}


class RoleFlip:
    """The flip state of one engine loop. `emit(sink, item)` queues an item for the HTTP
    thread (`EngineLoop._emit`)."""

    def __init__(self, engine: Engine, metrics: WorkerMetrics, moves_kv: bool,
                 emit: Callable[[Sink, object], None]) -> None:
        self.engine, self.metrics, self.moves_kv, self._emit = engine, metrics, moves_kv, emit
        self._flip: Flip | None = None
        self.history = RoleHistory(engine.role, time.time())  # every completed change

    @property
    def role_since(self) -> float:
        """Wall clock: when the current role began."""
        return self.history.current.since

    @property
    def state(self) -> str:
        return SERVING if self._flip is None else DRAINING

    @property
    def flipping(self) -> bool:
        return self._flip is not None

    @property
    def target(self) -> Role | None:
        """The role a flip under way goes to."""
        return None if self._flip is None else self._flip.role

    def refusal(self) -> str:
        """Why a leg submitted now is refused (while flipping)."""
        assert self._flip is not None
        return (f"{FLIPPING} ({self.engine.role.value} -> {self._flip.role.value}); send the "
                f"leg to another worker")

    def begin(self, cmd: Flip) -> None:
        refusal = self._refusal(cmd)
        if refusal is not None:
            log.info("role change to %s refused: %s", cmd.role.value, refusal.message)
            self._emit(cmd.reply, refusal)
            return
        self._flip = cmd
        log.info("role change %s -> %s: taking no new legs; draining for up to %.1f s",
                 self.engine.role.value, cmd.role.value, cmd.timeout_s)

    def advance(self, holds_work: bool) -> bool:
        """After an iteration of the engine loop: switch unless something still holds the flip,
        give up past the deadline. True: the role changed just now."""
        cmd = self._flip
        if cmd is None:
            return False
        seconds = time.perf_counter() - cmd.issued
        if not holds_work:
            old = self.engine.role
            self.engine.set_role(cmd.role)
            self._end(FlipDone(old, cmd.role, seconds))
            self.history.changed(cmd.role, time.time(), seconds)
            self.metrics.flipped(old.value, cmd.role.value, seconds)
            log.info("role changed %s -> %s in %.3f s", old.value, cmd.role.value, seconds)
            return True
        if seconds > cmd.timeout_s:
            self._end(ApiError(503, f"the worker did not drain within {cmd.timeout_s:g} s; it "
                                    f"keeps the role {self.engine.role.value} and takes legs "
                                    f"again", type=SERVER_ERROR, code="drain_timeout"))
            self.metrics.role_flip_timeouts.inc()
            log.warning("role change %s -> %s given up after %.1f s: still draining",
                        self.engine.role.value, cmd.role.value, seconds)
        return False

    def _end(self, reply: FlipDone | ApiError) -> None:
        assert self._flip is not None
        self._emit(self._flip.reply, reply)
        self._flip = None

    def _refusal(self, cmd: Flip) -> ApiError | None:
        if self._flip is not None:
            return ApiError(409, f"a role change to {self._flip.role.value} is in progress",
                            code="flip_in_progress")
        if cmd.role == self.engine.role:
            return ApiError(409, f"this worker is {cmd.role.value} already", param="role",
                            code="same_role")
        if cmd.role is not Role.COLLOCATED and not self.moves_kv:
            return ApiError(409, f"this worker has no KV transfer endpoint, so it cannot be "
                                 f"{cmd.role.value}: start it with --secret-file (and, on a "
                                 f"GPU, --transport nixl)", param="role", code="role_unavailable")
        return None

