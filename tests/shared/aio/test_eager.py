"""eager_future: a coroutine runs in place, and a task carries on only if it waits."""

from __future__ import annotations

import asyncio
import contextvars
import sys

import pytest

from shared.aio.eager import eager_future

seen: contextvars.ContextVar[str] = contextvars.ContextVar("seen", default="")


async def test_a_coroutine_that_never_waits_finishes_before_eager_future_returns():
    done = []

    async def work() -> int:
        done.append(asyncio.current_task())
        return 7

    fut = eager_future(asyncio.get_running_loop(), work())
    assert fut.done() and fut.result() == 7
    if sys.version_info >= (3, 12):  # an eager task: its own, current while it ran
        assert done == [fut] and done[0] is not asyncio.current_task()
    else:  # ran bare in the caller's turn, no task of its own
        assert done == [asyncio.current_task()]


async def test_wait_for_works_in_a_handler_started_from_a_protocol_callback():
    """A protocol callback has no current task; on 3.12+ wait_for (asyncio.timeout)
    refused to run there, and every offload from the agent's API answered 500."""
    loop = asyncio.get_running_loop()
    started: list[asyncio.Future[str]] = []

    async def handler() -> str:
        fut = loop.create_future()
        loop.call_later(0.01, fut.set_result, "answer")
        return await asyncio.wait_for(fut, 5.0)

    loop.call_soon(lambda: started.append(eager_future(loop, handler())))
    await asyncio.sleep(0)
    assert await asyncio.wait_for(started[0], 5.0) == "answer"


async def test_a_coroutine_that_waits_is_carried_on_by_a_task_with_its_result():
    gate = asyncio.get_running_loop().create_future()
    steps = []

    async def work() -> str:
        steps.append("before")
        value = await gate
        steps.append(value)
        await asyncio.sleep(0)  # a bare yield is passed on too
        return value * 2

    fut = eager_future(asyncio.get_running_loop(), work())
    assert steps == ["before"] and not fut.done()
    gate.set_result("x")
    assert await fut == "xx" and steps == ["before", "x"]


async def test_eager_future_carries_errors_raised_before_and_after_the_first_wait():
    async def early() -> None:
        raise ValueError("early")

    async def late() -> None:
        await asyncio.sleep(0)
        raise KeyError("late")

    loop = asyncio.get_running_loop()
    before = eager_future(loop, early())
    assert before.done()
    with pytest.raises(ValueError):
        await before
    with pytest.raises(KeyError):
        await eager_future(loop, late())


async def test_cancelling_the_task_cancels_the_coroutine_where_it_waits():
    cleaned = []

    async def work() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            cleaned.append(True)

    task = eager_future(asyncio.get_running_loop(), work())
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == [True]


async def test_context_changes_stay_with_the_coroutine_and_its_task():
    async def work() -> str:
        seen.set("inside")
        await asyncio.sleep(0)
        return seen.get()

    fut = eager_future(asyncio.get_running_loop(), work())
    assert seen.get() == ""  # the caller's context is untouched
    assert await fut == "inside"
