"""What the HTTP thread asks of the engine thread (`EngineLoop`'s command queue), and where a
leg's items go back.

Commands are taken in the order they were put; `Stop` ends the taking (the loop then sees its
stop flag).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from pdserve.common.engine_options import Role
from pdserve.legs.protocol import LegRequest


class Sink(Protocol):
    """Where a leg's items go, on the HTTP thread: a `QueueSink` (read by `events`), or a leg
    channel's own sink. Items: `Accepted` or a final error `TokenEvent` first, then events,
    the last one final. One delivery puts the items of one engine-loop iteration, then calls
    `delivered` once on each sink it put into: a sink that sends sends then, in the same turn
    of the HTTP thread's loop."""

    def put_nowait(self, item: object) -> None: ...

    def delivered(self) -> None: ...


class Reply:
    """The sink of a command's one reply (a `Flip`'s, a `Pin`'s): resolves the future the HTTP
    handler awaits (on the HTTP thread, from the engine loop's delivery). A handler gone
    already (its client left) leaves the future cancelled; the command ran all the same."""

    def __init__(self, future: asyncio.Future[object]) -> None:
        self.future = future

    def put_nowait(self, item: object) -> None:
        if not self.future.done():
            self.future.set_result(item)

    def delivered(self) -> None:
        """Nothing to send: the awaiting handler answers."""


@dataclass(frozen=True)
class Submit:
    """Run a leg; its items go to `sink`."""

    req: LegRequest
    sink: Sink
    arrived: float  # perf_counter() at submission: a leg's latency counts from here
    # a router's leg: a role change may hand it back for the router to continue elsewhere (a
    # client's own /v1 request has no one to continue it: a role change waits for it)
    movable: bool = False


@dataclass(frozen=True)
class Cancel:
    """The consumer of the leg `request_id` went away: end it and free its blocks."""

    request_id: str


@dataclass(frozen=True)
class Flip:
    """Change the worker's role once what it holds has drained (`workers/role_flip.py`);
    `reply` gets exactly one item, a `FlipDone` or an `ApiError`."""

    role: Role
    timeout_s: float  # the longest drain, counted from `issued`
    reply: Sink
    issued: float  # perf_counter() when the HTTP thread took the command


@dataclass(frozen=True)
class Pin:
    """Compute on `cpus` from the next step on (`workers/cpu_pin.py`); `reply` gets exactly
    one item, a `PinDone` or an `ApiError`."""

    cpus: tuple[int, ...]
    reply: Sink


@dataclass(frozen=True)
class Stop:
    """Wake the engine thread so that it sees its stop flag."""


Command = Submit | Cancel | Flip | Pin | Stop
