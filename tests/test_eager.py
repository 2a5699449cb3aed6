"""start_eagerly: a coroutine runs now up to its first suspension, and a Task finishes it."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.eager import start_eagerly


def test_a_coroutine_that_never_suspends_is_done_on_return() -> None:
    ran: list[str] = []

    async def send() -> None:
        ran.append("sent")

    async def main() -> None:
        assert start_eagerly(send()) is None
        assert ran == ["sent"]  # before the loop turned once

    asyncio.run(main())


def test_an_error_before_the_first_suspension_reaches_the_caller() -> None:
    async def broken() -> None:
        raise ConnectionResetError("gone")

    async def main() -> None:
        with pytest.raises(ConnectionResetError, match="gone"):
            start_eagerly(broken())

    asyncio.run(main())


def test_a_suspended_coroutine_is_finished_by_the_task() -> None:
    steps: list[str] = []

    async def send(gate: asyncio.Future) -> int:
        steps.append("written")
        got = await gate  # back-pressure
        await asyncio.sleep(0)
        steps.append("drained")
        return got + 1

    async def main() -> None:
        gate = asyncio.get_running_loop().create_future()
        task = start_eagerly(send(gate))
        assert task is not None and steps == ["written"]
        await asyncio.sleep(0.01)
        assert not task.done()
        gate.set_result(41)
        assert await task == 42
        assert steps == ["written", "drained"]

    asyncio.run(main())


def test_an_error_after_suspending_is_the_tasks() -> None:
    async def send(gate: asyncio.Future) -> None:
        await gate

    async def main() -> None:
        gate = asyncio.get_running_loop().create_future()
        task = start_eagerly(send(gate))
        gate.set_exception(BrokenPipeError("peer closed"))
        with pytest.raises(BrokenPipeError, match="peer closed"):
            await task

    asyncio.run(main())


@pytest.mark.parametrize("wait", ["future", "bare yield"])
def test_cancelling_the_task_cancels_the_coroutine_where_it_waits(wait: str) -> None:
    cleaned: list[bool] = []

    async def send(gate: asyncio.Future) -> None:
        try:
            if wait == "future":
                await gate
            else:
                while True:
                    await asyncio.sleep(0)
        finally:
            cleaned.append(True)

    async def main() -> None:
        gate = asyncio.get_running_loop().create_future()
        task = start_eagerly(send(gate))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cleaned == [True]
        assert gate.cancelled() == (wait == "future")

    asyncio.run(main())
