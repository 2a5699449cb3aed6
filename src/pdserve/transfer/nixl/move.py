"""One NIXL move, the fence that quiets it (`NixlTransport.cancel` / `close`), and the
timeouts that bound both."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.transfer.peer import PeerId
from pdserve.transfer.tcp.options import TcpOptions
from pdserve.transfer.transport import MoveHandle, MoveStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NixlOptions:
    """`cancel_wait_s`: how long `cancel` waits for NIXL to report a move finished before it
    asks NIXL to abort it. `meta_timeout_s`: how long a move waits for the peer's metadata
    (a peer without a registered pool never sends any). `dead_grace_s`: how long a move to a
    peer the TCP channel reports dead may stay pending before it is reported "error".
    `progress_thread`: NIXL's own progress thread (without it UCX over TCP does not progress
    the target side of a write, and moves stall). It sleeps in poll() on the UCX workers' event
    descriptors, so traffic wakes it at once, and wakes at least every `progress_poll_ms`
    otherwise. (NIXL's Python API hard-codes a zero poll timeout: the thread then spins, a core
    per endpoint even when idle; `make_agent` in transport.py sets this value instead.)"""

    cancel_wait_s: float = 5.0
    meta_timeout_s: float = 5.0
    dead_grace_s: float = 0.5
    progress_thread: bool = True
    progress_poll_ms: int = 10
    tcp: TcpOptions = field(default_factory=TcpOptions)

    def __post_init__(self) -> None:
        for name in ("cancel_wait_s", "meta_timeout_s", "dead_grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"NixlOptions.{name} must be > 0, got {getattr(self, name)}")
        if not isinstance(self.progress_poll_ms, int) or self.progress_poll_ms < 1:
            raise ValueError("NixlOptions.progress_poll_ms must be a whole number >= 1, got "
                             f"{self.progress_poll_ms!r}")


@dataclass(eq=False)
class NixlMove:
    """One write or read. Guarded by the transport's lock.

    `xfer` is the NIXL request while NIXL may still touch memory for it (posted and not yet
    confirmed finished or aborted); None before posting and after it is released. `status` is
    what `Transport.status` reports and can be terminal while `xfer` is still set (a dead peer's
    move is reported "error" before NIXL lets go); only `quiesce` clears `xfer` for a posted
    move, and that is the fence."""

    handle: MoveHandle
    kind: str  # "write" | "read"
    peer: PeerId
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    created: float
    layers: tuple[int, int] | None = None  # a write's [first, end) layers; None: every layer
    status: MoveStatus = "pending"
    cancelled: bool = False
    xfer: Any = field(default=None, repr=False)
    dead_since: float | None = None
    posted_at: float | None = None  # when NIXL took the request (its link time starts)

    def finish(self, status: MoveStatus) -> None:
        """pending -> status, never back."""
        if self.status == "pending":
            self.status = status


def release(agent: Any, move: NixlMove) -> bool:
    """Release the move's NIXL request (NIXL aborts it if still active); True when freed."""
    if move.xfer is None:
        return True
    try:
        agent.release_xfer_handle(move.xfer)
    except Exception as e:  # NIXL raises when it cannot cancel an active request
        log.debug("release of move %d refused: %s", move.handle, e)
        return False
    move.xfer = None
    return True


def poll(agent: Any, move: NixlMove) -> str:
    """NIXL's view of a posted move: "DONE", "PROC" or "ERR" (an exception counts as ERR)."""
    try:
        return agent.check_xfer_state(move.xfer)
    except Exception as e:
        log.warning("checking move %d failed: %s", move.handle, e)
        return "ERR"


def quiesce(agent: Any, move: NixlMove, wait_s: float) -> bool:
    """Wait up to `wait_s` for NIXL to report the move DONE or ERR, then release it; past the
    wait, ask NIXL to abort it by releasing. True once NIXL holds no request for the move (it
    will never touch memory for it again); False if NIXL refused to let it go."""
    deadline = time.monotonic() + wait_s
    while move.xfer is not None and time.monotonic() < deadline:
        if poll(agent, move) != "PROC":
            return release(agent, move)
        time.sleep(0.0005)
    return release(agent, move)
