"""Start a coroutine at once, in the caller's turn of the event loop.

`asyncio.ensure_future(coro)` runs nothing until the loop's next iteration. On a worker pinned
to one core, every iteration of its HTTP thread takes the GIL and the core from the engine
thread in the middle of a step, so a send that waits for one lengthens the step (a token's
send through the leg channel took three iterations; see `workers/leg_channel.py`).
`start_eagerly` runs the coroutine up to its first suspension now, as Python 3.12's eager
tasks do (this project supports 3.11): an uncompressed WebSocket frame is written before its
coroutine first awaits (only for back-pressure), so the send is done when this returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def start_eagerly(coro: Coroutine[Any, Any, Any]) -> asyncio.Task | None:
    """Run `coro` until it first suspends. None if it finished (an exception it raised before
    suspending propagates here); else a Task that finishes it, with its result or exception.
    Cancelling the Task cancels `coro` where it waits."""
    try:
        waiting_on = coro.send(None)
    except StopIteration:
        return None
    except BaseException:
        coro.close()
        raise
    return asyncio.ensure_future(_finish(coro, waiting_on))


async def _finish(coro: Coroutine[Any, Any, Any], waiting_on: Any) -> Any:
    """Drive a suspended coroutine as a Task would. It yielded the future it waits on (None
    for a bare yield, one turn of the loop); it is resumed with `send(None)` once that future
    is done, and its await then reads the result. Cancelled while it waits: the future is
    cancelled, and the coroutine sees that where it waits."""
    while True:
        resume = coro.send
        try:
            if waiting_on is None:
                await asyncio.sleep(0)
            else:
                await asyncio.wait([waiting_on])  # done, whatever the outcome; never raises
        except asyncio.CancelledError:
            if waiting_on is not None:
                waiting_on.cancel()
                continue  # resume once it is done cancelling

            def resume(_: None) -> Any:
                return coro.throw(asyncio.CancelledError())
        try:
            waiting_on = resume(None)
        except StopIteration as done:
            return done.value
