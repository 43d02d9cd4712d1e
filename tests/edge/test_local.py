"""The local runtimes' queue: bounded, and a request past the bound is refused at once."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from edge.local import LocalModels
from shared.errors import Overloaded
from shared.repository import ModelRepository
from tests.support import write_linear_model


async def test_requests_past_the_local_backlog_are_refused_not_queued(tmp_path):
    write_linear_model(tmp_path / "lin" / "1" / "model.onnx", seed=1)
    local = LocalModels(ModelRepository(tmp_path), latency_floor_s=0.3, max_backlog=2)
    await asyncio.to_thread(local.load, "lin")
    x = {"x": np.ones((1, 4), np.float32)}
    running = [asyncio.ensure_future(local.run("lin", x)) for _ in range(2)]
    await asyncio.sleep(0.05)
    with pytest.raises(Overloaded, match="2 requests waiting"):
        await local.run("lin", x)
    results = await asyncio.gather(*running)
    assert all(out["y"].shape == (1, 3) for out, _ in results)
    assert local.backlog("lin") == 0
    await local.run("lin", x)  # room again
    local.close()


async def test_a_tiny_local_model_runs_on_the_loop_once_warmed_and_never_behind_a_backlog(
    tmp_path,
):
    import threading

    from shared.runtimes.inline import WARMUP_RUNS

    write_linear_model(tmp_path / "lin" / "1" / "model.onnx", seed=1)
    local = LocalModels(ModelRepository(tmp_path), inline_us=1e9)
    model = await asyncio.to_thread(local.load, "lin")
    threads: list[int] = []
    inner = model.session.run

    def recording_run(inputs, outputs=None):
        threads.append(threading.get_ident())
        return inner(inputs, outputs)

    model.session.run = recording_run  # type: ignore[method-assign]
    x = {"x": np.ones((1, 4), np.float32)}
    for _ in range(WARMUP_RUNS + 2):
        out, _ = await local.run("lin", x)
        assert out["y"].shape == (1, 3)
    loop = threading.get_ident()
    assert loop not in threads[:WARMUP_RUNS]
    assert threads[WARMUP_RUNS:] == [loop, loop]
    # a larger input than any seen goes to the worker; one behind it goes there too
    threads.clear()
    big = {"x": np.ones((64, 4), np.float32)}
    await asyncio.gather(local.run("lin", big), local.run("lin", x))
    assert len(threads) == 2 and loop not in threads
    local.close()


async def test_a_run_still_queued_at_its_deadline_is_refused_not_answered_late(tmp_path):
    # Queued behind others, local runs answered 200 seconds past a 100 ms deadline.
    import time

    from shared.errors import DeadlineExceeded

    write_linear_model(tmp_path / "lin" / "1" / "model.onnx")
    local = LocalModels(ModelRepository(tmp_path), latency_floor_s=0.2)  # one at a time
    local.load("lin")
    x = {"x": np.ones((1, 4), np.float32)}
    deadline = time.monotonic() + 0.15  # the second would start at 0.2 s
    runs = [local.run("lin", x, deadline=deadline) for _ in range(3)]
    results = await asyncio.gather(*runs, return_exceptions=True)
    assert not isinstance(results[0], BaseException)  # it started in time: it answers
    assert all(isinstance(r, DeadlineExceeded) for r in results[1:]), results
    assert "before the run could start" in str(results[2])
    with pytest.raises(DeadlineExceeded):  # already past: not even queued
        await local.run("lin", x, deadline=time.monotonic() - 0.01)
    assert local.backlog("lin") == 0
    local.close()


async def test_a_run_queued_on_the_session_thread_past_its_deadline_does_not_start(tmp_path):
    # The check in the session thread, as a queued job starts: a real model's runs,
    # slowed to 0.2 s each, with no device emulation.
    import time

    from shared.errors import DeadlineExceeded

    write_linear_model(tmp_path / "lin" / "1" / "model.onnx")
    local = LocalModels(ModelRepository(tmp_path))
    model = local.load("lin")
    started = []
    run_sync = model.run_sync

    def slow(inputs, outputs, cancel=None):
        started.append(time.monotonic())
        time.sleep(0.2)
        return run_sync(inputs, outputs, cancel)

    model.run_sync = slow
    x = {"x": np.ones((1, 4), np.float32)}
    deadline = time.monotonic() + 0.1  # the second would start at 0.2 s
    results = await asyncio.gather(
        *(local.run("lin", x, deadline=deadline) for _ in range(3)), return_exceptions=True
    )
    assert not isinstance(results[0], BaseException)
    assert all(isinstance(r, DeadlineExceeded) for r in results[1:]), results
    assert len(started) == 1  # the late ones never ran
    local.close()


def test_a_load_that_finishes_after_close_is_closed_not_kept(tmp_path):
    # A reload cut short by a stop kept loading in its thread and left a session open.
    from shared.errors import ModelNotReady

    write_linear_model(tmp_path / "lin" / "1" / "model.onnx")
    local = LocalModels(ModelRepository(tmp_path))
    local.close()
    with pytest.raises(ModelNotReady, match="stopping"):
        local.load("lin")
    assert local.names() == []


async def test_a_cancelled_queued_run_is_skipped_and_a_deadline_is_met_while_queued(tmp_path):
    """A cancelled caller's run was still made, in the place of the requests behind it
    (a later 1-row request waited 1.75 s), and a queued request heard of its deadline
    only once the thread reached it (1.02 s for a 0.7 s deadline)."""
    import time

    from shared.errors import DeadlineExceeded

    write_linear_model(tmp_path / "lin" / "1" / "model.onnx")
    local = LocalModels(ModelRepository(tmp_path))
    model = local.load("lin")
    ran = []
    run_sync = model.run_sync

    def slow(inputs, outputs, cancel=None):
        ran.append(float(inputs["x"][0, 0]))
        time.sleep(1.0 if ran[-1] == 6.0 else 0.2)
        return run_sync(inputs, outputs, cancel)

    model.run_sync = slow

    def x(v: float) -> dict[str, np.ndarray]:
        return {"x": np.full((1, 4), v, np.float32)}

    first = asyncio.ensure_future(local.run("lin", x(1)))
    queued = [asyncio.ensure_future(local.run("lin", x(v))) for v in (2, 3, 4)]
    await asyncio.sleep(0.05)
    for task in queued:
        task.cancel()
    last = await local.run("lin", x(5))
    assert not isinstance(await first, BaseException) and last
    assert ran == [1.0, 5.0]  # the cancelled ones never ran
    assert local.backlog("lin") == 0
    blocker = asyncio.ensure_future(local.run("lin", x(6)))
    await asyncio.sleep(0.02)
    with pytest.raises(DeadlineExceeded, match="before the run could start"):
        await local.run("lin", x(7), deadline=time.monotonic() + 0.05)
    assert not blocker.done()  # told at its deadline, not once the thread got to it
    await blocker
    await asyncio.sleep(0.05)
    assert 7.0 not in ran and local.backlog("lin") == 0
    local.close()


async def test_runs_given_up_while_queued_count_against_the_bound_until_the_thread_drops_them(
    tmp_path,
):
    """Past their deadline they were uncounted at once while they stayed queued on the
    thread, each holding its inputs: 490 of them (8 MB) behind one 2 s run."""
    import time

    from shared.errors import DeadlineExceeded

    write_linear_model(tmp_path / "lin" / "1" / "model.onnx")
    local = LocalModels(ModelRepository(tmp_path), max_backlog=4)
    model = local.load("lin")
    run_sync = model.run_sync

    def slow(inputs, outputs, cancel=None):
        time.sleep(0.5)
        return run_sync(inputs, outputs, cancel)

    model.run_sync = slow
    x = {"x": np.ones((1, 4), np.float32)}
    blocker = asyncio.ensure_future(local.run("lin", x))
    await asyncio.sleep(0.05)
    outcomes = await asyncio.gather(
        *(local.run("lin", x, deadline=time.monotonic() + 0.02) for _ in range(10)),
        return_exceptions=True,
    )
    late = [o for o in outcomes if isinstance(o, DeadlineExceeded)]
    refused = [o for o in outcomes if isinstance(o, Overloaded)]
    assert len(late) == 3 and len(refused) == 7, outcomes  # the blocker + 3 fill the 4
    await blocker
    await asyncio.sleep(0.1)  # the thread has dropped the three
    assert local._queued["lin"] == 0
    assert await local.run("lin", x)  # room again
    local.close()


def test_a_folder_past_the_machines_bounds_is_refused_by_key_as_the_cloud_refuses_it(tmp_path):
    # 100,000 threads: the cloud said 400 naming the key; the agent tried to build the
    # session and hung its start-up, its memory growing without end.
    from shared.errors import ConfigError

    write_linear_model(tmp_path / "lin" / "1" / "model.onnx", seed=1)
    (tmp_path / "lin" / "config.toml").write_text(
        "max_batch_size = 8\n[runtime]\nthreads = 100000\n"
    )
    local = LocalModels(ModelRepository(tmp_path))
    with pytest.raises(ConfigError, match=r"config.toml: key 'runtime.threads': 100000 exceeds"):
        local.load("lin")
    local.close()


async def test_the_models_queue_policy_bounds_and_times_its_local_queue(tmp_path):
    # The agent's /config showed max_queue_size and default_timeout_us, which only the
    # cloud applied: every request queued, and ones queued past the timeout got 200.
    from shared.errors import DeadlineExceeded

    write_linear_model(tmp_path / "lin" / "1" / "model.onnx", seed=1)
    (tmp_path / "lin" / "config.toml").write_text(
        "max_batch_size = 1\n[dynamic_batching]\nmax_queue_size = 2\ndefault_timeout_us = 500000\n"
    )
    local = LocalModels(ModelRepository(tmp_path), latency_floor_s=0.3, max_backlog=64)
    await asyncio.to_thread(local.load, "lin")
    x = {"x": np.ones((1, 4), np.float32)}
    flights = [asyncio.ensure_future(local.run("lin", x)) for _ in range(3)]  # 1 runs, 2 wait
    await asyncio.sleep(0.05)
    with pytest.raises(Overloaded, match=r"2 requests queued behind the one running \(max_"):
        await local.run("lin", x)
    done = await asyncio.gather(*flights, return_exceptions=True)
    # 0.3 s each, one at a time: the third would start at 0.6 s, past its 0.5 s in the queue
    assert [type(d).__name__ for d in done] == ["tuple", "tuple", "DeadlineExceeded"]
    assert isinstance(done[2], DeadlineExceeded)
    local.close()


async def test_a_request_waiting_for_the_emulated_device_is_refused_at_its_deadline(tmp_path):
    # It had waited for the device to be free (200 ms) and only then found its deadline
    # long passed: a 504 ~100 ms late.
    import time

    from shared.errors import DeadlineExceeded

    write_linear_model(tmp_path / "lin" / "1" / "model.onnx", seed=1)
    local = LocalModels(ModelRepository(tmp_path), latency_floor_s=0.3)
    await asyncio.to_thread(local.load, "lin")
    x = {"x": np.ones((1, 4), np.float32)}
    busy = asyncio.ensure_future(local.run("lin", x))
    await asyncio.sleep(0.05)
    with pytest.raises(DeadlineExceeded):
        await local.run("lin", x, deadline=time.monotonic() + 0.05)
    assert not busy.done()  # refused while the device was still busy, not once it was free
    await busy
    local.close()


@pytest.mark.parametrize("emulated", [False, True])
async def test_runs_still_queued_when_the_agent_stops_are_answered_shutting_down_not_made(
    tmp_path, emulated
):
    # The agent's drain ran out with 250 local runs queued: each was still made, one
    # after another, while its app had been cut off, and the exit took 37 s.
    import time

    from shared.errors import ShuttingDown

    write_linear_model(tmp_path / "lin" / "1" / "model.onnx")
    local = LocalModels(ModelRepository(tmp_path), latency_floor_s=0.2 if emulated else 0.0)
    model = local.load("lin")
    started = []
    run_sync = model.run_sync

    def slow(inputs, outputs, cancel=None):
        started.append(time.monotonic())
        time.sleep(0 if emulated else 0.2)
        return run_sync(inputs, outputs, cancel)

    model.run_sync = slow
    x = {"x": np.ones((1, 4), np.float32)}
    runs = [asyncio.ensure_future(local.run("lin", x)) for _ in range(6)]
    await asyncio.sleep(0.05)
    local.stop_queued()
    t0 = time.monotonic()
    results = await asyncio.gather(*runs, return_exceptions=True)
    assert not isinstance(results[0], BaseException)  # the run under way ends
    assert all(isinstance(r, ShuttingDown) for r in results[1:]), results
    assert time.monotonic() - t0 < 0.5  # (not 0.2 s for each)
    assert emulated or len(started) <= 2  # (emulated: each computes at once, then waits)
    with pytest.raises(ShuttingDown):
        await local.run("lin", x)
    local.close()
