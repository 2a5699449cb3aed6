"""`run_once_in_thread`: the call's result or exception comes back, and its thread is gone by
then (a live idle thread left with an OpenMP team halves the engine's speed: oneshot.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from pdserve.workers.oneshot import run_once_in_thread


def _alive(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_the_result_comes_back_and_the_thread_has_ended() -> None:
    def work(n: int) -> tuple[str, float]:
        x = torch.ones(256, 256)
        return threading.current_thread().name, float((x @ x).sum()) + n  # OpenMP inside

    async def go() -> None:
        name, value = await run_once_in_thread(work, 1, name="oneshot-test")
        assert name == "oneshot-test" and value == 256.0**3 + 1
        assert _alive("oneshot-test") == []

    asyncio.run(go())


def test_an_exception_is_raised_in_the_awaiting_task_and_the_thread_has_ended() -> None:
    def fail() -> None:
        raise ValueError("bad model folder")

    async def go() -> None:
        with pytest.raises(ValueError, match="bad model folder"):
            await run_once_in_thread(fail, name="oneshot-fail")
        assert _alive("oneshot-fail") == []

    asyncio.run(go())
