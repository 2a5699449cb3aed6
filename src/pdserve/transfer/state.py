"""The life of one KV transfer: an ordered, monotonic state and the holder that enforces it.

States only move forward (to a larger value). DONE and FAILED are terminal and sit last, so
`state >= DONE` is the whole terminal check and FAILED is reachable from every live state by
the same forward rule. Once terminal, nothing changes a transfer: a late or duplicate message
(a "blocks ready" after a timeout failed it, a second completion) is ignored, never revives it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import IntEnum


class TransferState(IntEnum):
    BOOTSTRAPPING = 1  # peers handshaking: descriptor sent or expected
    WAITING_FOR_BLOCKS = 2  # destination blocks reserved or awaited; no bytes moved yet
    TRANSFERRING = 3  # bytes in flight
    DONE = 4  # every slice landed and verified (terminal)
    FAILED = 5  # terminal; larger than DONE so that `>= DONE` means terminal

    @property
    def is_terminal(self) -> bool:
        return self >= TransferState.DONE


class TransferStatus:
    """Where one transfer stands: its state, when it entered each state, why it failed.

    Invariants: `state` never decreases; after DONE or FAILED it never changes; `reason` is set
    exactly when the state is FAILED; `entered_at` holds a time for every state entered (skipped
    states have none). Safe to share between threads (transport callbacks and the engine loop).
    Lifetime: one per transfer id, from the first message to the release of its blocks.
    """

    def __init__(
        self,
        state: TransferState = TransferState.BOOTSTRAPPING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if state.is_terminal:
            raise ValueError(
                f"a transfer starts live; create it in a state below DONE, not {state.name}"
            )
        self._clock = clock
        self._lock = threading.Lock()
        self._state = state
        self._reason: str | None = None
        self._entered_at: dict[TransferState, float] = {state: clock()}

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def reason(self) -> str | None:
        """Why the transfer failed; None unless FAILED."""
        return self._reason

    @property
    def is_terminal(self) -> bool:
        return self._state.is_terminal

    def entered_at(self, state: TransferState) -> float | None:
        """Clock time at which the transfer entered `state`, None if it never did."""
        return self._entered_at.get(state)

    def advance(self, new: TransferState, reason: str | None = None) -> bool:
        """Move forward to `new`; returns whether the state changed.

        A move to the current or an earlier state, or any move once terminal, is ignored and
        returns False. FAILED needs a `reason` (what went wrong, for logs and the client);
        other states take none.
        """
        if (new is TransferState.FAILED) != bool(reason):
            raise ValueError(
                "pass a non-empty reason exactly when advancing to FAILED "
                f"(got state {new.name}, reason {reason!r})"
            )
        with self._lock:
            if self._state.is_terminal or new <= self._state:
                return False
            self._state = new
            self._reason = reason
            self._entered_at[new] = self._clock()
            return True

    def fail(self, reason: str) -> bool:
        """Shorthand for `advance(FAILED, reason)`; False if already terminal."""
        return self.advance(TransferState.FAILED, reason)

    def __repr__(self) -> str:
        suffix = f", reason={self._reason!r}" if self._reason else ""
        return f"TransferStatus({self._state.name}{suffix})"
