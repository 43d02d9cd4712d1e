"""Session threads: work runs in order off the loop, and outcomes come back on it."""

from __future__ import annotations

import asyncio
import threading

from shared.aio.threads import SessionThread


async def test_work_runs_in_order_on_its_own_thread_and_reports_on_the_loop() -> None:
    loop = asyncio.get_running_loop()
    worker = SessionThread("t", loop)
    seen: list[tuple[int, bool, bool]] = []
    done = asyncio.Event()

    def job(i: int) -> int:
        return i * 10

    def report(result, error) -> None:
        on_loop = threading.current_thread() is threading.main_thread()
        seen.append((result, error is None, on_loop))
        if len(seen) == 3:
            done.set()

    for i in range(3):
        worker.submit(job, (i,), report)
    await asyncio.wait_for(done.wait(), 5)
    assert seen == [(0, True, True), (10, True, True), (20, True, True)]
    worker.stop()


async def test_an_error_in_the_work_is_handed_to_the_loop_not_lost() -> None:
    loop = asyncio.get_running_loop()
    worker = SessionThread("t", loop)
    got: asyncio.Future = loop.create_future()

    def boom() -> None:
        raise ValueError("runtime failed")

    worker.submit(boom, (), lambda result, error: got.set_result(error))
    error = await asyncio.wait_for(got, 5)
    assert isinstance(error, ValueError) and "runtime failed" in str(error)
    worker.stop()
