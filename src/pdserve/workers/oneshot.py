"""Run one call in a thread of its own that ends with the call, and await its result.

Why not `asyncio.to_thread`: its executor keeps the thread alive, idle, for later calls. A
worker loads its model in such a thread while `/health` answers 503, and loading runs OpenMP
parallel regions, so that thread keeps an idle OpenMP team. libgomp counts the team's threads
as managed: with more managed threads than cores it cuts its spin-wait between parallel
regions to almost nothing (GOMP_SPINCOUNT's "throttled" count, libgomp env.c), and from then on
each of a decode step's ~300 regions puts the engine's compute threads to sleep and wakes them
again. Measured here (2 cores, SmolLM2 bf16, 16 requests x ~215 tokens): a step took 36 ms
with the loading thread left alive against 18.7 ms without it, with 26,610 context switches
against 346 over the run; served decode steps took 42 ms against 20 ms in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def run_once_in_thread(fn: Callable[..., T], *args: object, name: str = "oneshot") -> T:
    """fn(*args) in a new thread; returns its result or raises its exception. The thread has
    ended (joined) before this returns."""
    aio = asyncio.get_running_loop()
    done: asyncio.Future = aio.create_future()

    def settle(result: object, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the awaiting task
            error = e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            aio.call_soon_threadsafe(settle, result, error)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        return await done
    finally:
        if not done.cancelled():  # cancelled: the call runs on, in a daemon thread
            thread.join()  # it has handed over its outcome: only its exit is left
