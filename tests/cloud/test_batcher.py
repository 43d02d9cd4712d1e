"""DynamicBatcher over a real ONNX Runtime session on tiny models built here.

Merging is made deterministic without timing: a gate around the real session
holds the first batch in flight while the test queues more requests.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cloud.batcher import BatchResult, DynamicBatcher
from cloud.stats import ModelStats
from shared.errors import (
    DeadlineExceeded,
    FerryError,
    InvalidInput,
    ModelNotReady,
    Overloaded,
)
from shared.repository.config import DynamicBatching
from shared.runtimes import RuntimeOptions, load_session

RNG = np.random.default_rng(7)
W = RNG.standard_normal((4, 3)).astype(np.float32)
B = RNG.standard_normal(3).astype(np.float32)
TABLE = np.arange(8, dtype=np.float32).reshape(4, 2)


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def build_linear(path: Path) -> Path:
    """y = x @ W + b with a dynamic batch dimension."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["y"]),
        ],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "b")],
    )
    return _save(graph, path)


def build_gather(path: Path) -> Path:
    """y = TABLE[idx]: ONNX Runtime rejects an out-of-range index at run time."""
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "idx"], ["y"], axis=0)],
        "gather",
        [helper.make_tensor_value_info("idx", TensorProto.INT64, ["N", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1, 2])],
        [numpy_helper.from_array(TABLE, "table")],
    )
    return _save(graph, path)


class GatedSession:
    """A real session whose runs wait on ``gate``, so a test can hold a batch in flight."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.backend = inner.backend
        self.inputs = inner.inputs
        self.outputs = inner.outputs
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.seen: list[np.ndarray] = []  # first input of every run, in run order

    def run(self, inputs, outputs=None):
        self.seen.append(next(iter(inputs.values())).copy())
        self.entered.set()
        assert self.gate.wait(timeout=10), "test never opened the gate"
        return self.inner.run(inputs, outputs)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def linear(tmp_path):
    session = load_session(
        "onnxruntime", build_linear(tmp_path / "linear.onnx"), RuntimeOptions(threads=1)
    )
    yield session
    session.close()


@pytest.fixture
def gather(tmp_path):
    session = load_session(
        "onnxruntime", build_gather(tmp_path / "gather.onnx"), RuntimeOptions(threads=1)
    )
    yield session
    session.close()


def policy(**kw) -> DynamicBatching:
    kw.setdefault("max_queue_delay_us", 0)
    return DynamicBatching(**kw)


async def started(session, *, max_batch_size=8, policy_=None, stats=None) -> DynamicBatcher:
    batcher = DynamicBatcher(
        model="m",
        version=1,
        sessions=[session],
        max_batch_size=max_batch_size,
        policy=policy_ if policy_ is not None else policy(),
        stats=stats or ModelStats("m", 1),
    )
    await batcher.start()
    return batcher


async def until(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.001)


async def hold_first(batcher: DynamicBatcher, gated: GatedSession, inputs) -> asyncio.Task:
    """Start one request and wait until the session is busy with it."""
    task = asyncio.create_task(batcher.infer(inputs))
    assert await asyncio.to_thread(gated.entered.wait, 5)
    return task


async def run_queued(
    batcher: DynamicBatcher, gated: GatedSession, inputs: list[np.ndarray], first_rows: int = 1
) -> list[BatchResult]:
    """Hold a first run in the session, queue ``inputs`` behind it, then let all run."""
    first = await hold_first(batcher, gated, {"x": xs(first_rows)})
    tasks = [asyncio.create_task(batcher.infer({"x": x})) for x in inputs]
    await until(lambda: batcher.queue_depth == len(inputs))
    gated.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    await first
    return results


def xs(n: int) -> np.ndarray:
    return RNG.standard_normal((n, 4)).astype(np.float32)


def assert_linear(x: np.ndarray, result: BatchResult) -> None:
    np.testing.assert_allclose(result.outputs["y"], x @ W + B, rtol=1e-5, atol=1e-5)


async def test_queued_requests_are_merged_and_each_gets_its_own_slice(linear):
    gated = GatedSession(linear)
    stats = ModelStats("m", 1)
    batcher = await started(gated, stats=stats)
    first = await hold_first(batcher, gated, {"x": xs(1)})
    inputs = [xs(n) for n in (1, 2, 3, 1, 2, 1, 3)]
    tasks = [asyncio.create_task(batcher.infer({"x": x})) for x in inputs]
    await until(lambda: batcher.queue_depth == len(inputs))
    assert stats.pending == len(inputs)
    gated.gate.set()
    results = await asyncio.gather(*tasks)
    await first
    for x, result in zip(inputs, results, strict=True):
        assert_linear(x, result)
        assert result.outputs["y"].shape[0] == x.shape[0]
    snap = stats.snapshot()
    assert snap.success_count == len(inputs) + 1
    assert snap.execution_count < len(inputs) + 1
    assert max(snap.batch) > 1 and max(snap.batch) <= 8
    assert snap.inference_count == 1 + sum(x.shape[0] for x in inputs)
    assert stats.pending == 0
    await batcher.stop()


async def test_full_batch_dispatches_without_waiting_for_the_delay(linear):
    stats = ModelStats("m", 1)
    batcher = await started(
        linear, max_batch_size=4, policy_=policy(max_queue_delay_us=20_000_000), stats=stats
    )
    inputs = [xs(1) for _ in range(4)]
    results = await asyncio.wait_for(
        asyncio.gather(*(batcher.infer({"x": x}) for x in inputs)), timeout=10
    )
    for x, r in zip(inputs, results, strict=True):
        assert_linear(x, r)
        assert r.batch_size == 4
    assert stats.snapshot().batch == {4: (1, stats.snapshot().batch[4][1])}
    await batcher.stop()


async def test_largest_reachable_preferred_size_is_dispatched_at_once(linear):
    pol = policy(max_queue_delay_us=20_000_000, preferred_batch_sizes=[2, 3])
    batcher = await started(linear, max_batch_size=8, policy_=pol)
    inputs = [xs(1) for _ in range(6)]
    results = await asyncio.wait_for(
        asyncio.gather(*(batcher.infer({"x": x}) for x in inputs)), timeout=10
    )
    assert [r.batch_size for r in results] == [3, 3, 3, 3, 3, 3]
    for x, r in zip(inputs, results, strict=True):
        assert_linear(x, r)
    await batcher.stop()


async def test_a_queue_past_the_largest_preferred_size_still_sends_preferred_batches(linear):
    """A queue that filled max_batch_size went as one batch of 4, where Triton sends
    the preferred size (2) while the delay has not run out."""
    gated = GatedSession(linear)
    pol = policy(max_queue_delay_us=20_000_000, preferred_batch_sizes=[2])
    batcher = await started(gated, max_batch_size=4, policy_=pol)
    inputs = [xs(1) for _ in range(5)]
    results = await run_queued(batcher, gated, inputs)
    assert [r.batch_size for r in results] == [2, 2, 2, 2, 1]
    for x, r in zip(inputs, results, strict=True):
        assert_linear(x, r)
    await batcher.stop()


async def test_partial_batch_is_dispatched_when_the_queue_delay_expires(linear):
    batcher = await started(linear, policy_=policy(max_queue_delay_us=20_000))
    x = xs(2)
    result = await asyncio.wait_for(batcher.infer({"x": x}), timeout=10)
    assert_linear(x, result)
    assert result.batch_size == 2
    await batcher.stop()


async def test_without_a_dynamic_batching_policy_each_request_runs_alone(linear):
    gated = GatedSession(linear)
    stats = ModelStats("m", 1)
    batcher = DynamicBatcher(
        model="m", version=1, sessions=[gated], max_batch_size=8, policy=None, stats=stats
    )
    await batcher.start()
    first = await hold_first(batcher, gated, {"x": xs(1)})
    inputs = [xs(2) for _ in range(3)]
    tasks = [asyncio.create_task(batcher.infer({"x": x})) for x in inputs]
    await until(lambda: batcher.queue_depth == 3)
    gated.gate.set()
    for x, r in zip(inputs, await asyncio.gather(*tasks), strict=True):
        assert_linear(x, r)
    await first
    assert stats.snapshot().execution_count == 4
    await batcher.stop()


async def test_max_batch_size_zero_runs_each_request_alone(linear):
    gated = GatedSession(linear)
    stats = ModelStats("m", 1)
    batcher = await started(gated, max_batch_size=0, stats=stats)
    inputs = [xs(3) for _ in range(4)]
    for x, r in zip(inputs, await run_queued(batcher, gated, inputs, 2), strict=True):
        assert_linear(x, r)
        assert r.batch_size == 1
    snap = stats.snapshot()
    assert snap.execution_count == 5
    assert set(snap.batch) == {1}
    await batcher.stop()


async def test_request_whose_deadline_passes_in_the_queue_gets_deadline_exceeded(linear):
    gated = GatedSession(linear)
    stats = ModelStats("m", 1)
    batcher = await started(gated, stats=stats)
    first = await hold_first(batcher, gated, {"x": xs(1)})
    late = asyncio.create_task(batcher.infer({"x": xs(1)}, deadline=time.monotonic() + 0.05))
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(late, timeout=5)  # answered while the session is still busy
    assert batcher.queue_depth == 0
    gated.gate.set()
    await first
    with pytest.raises(DeadlineExceeded):
        await batcher.infer({"x": xs(1)}, deadline=time.monotonic() - 1)
    snap = stats.snapshot()
    assert (snap.success_count, snap.fail_count) == (1, 2)
    await batcher.stop()


async def test_default_timeout_applies_to_requests_without_a_deadline(linear):
    gated = GatedSession(linear)
    batcher = await started(gated, policy_=policy(default_timeout_us=50_000))
    first = await hold_first(batcher, gated, {"x": xs(1)})
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(batcher.infer({"x": xs(1)}), timeout=5)
    gated.gate.set()
    await first
    await batcher.stop()


@pytest.mark.parametrize("override", [True, False])
async def test_a_request_deadline_may_shorten_the_default_timeout_never_extend_it(linear, override):
    """A request whose own deadline was later than the model's default timeout had run
    past it (with allow_timeout_override): any client escaped the operator's bound."""
    gated = GatedSession(linear)
    batcher = await started(
        gated, policy_=policy(default_timeout_us=50_000, allow_timeout_override=override)
    )
    first = await hold_first(batcher, gated, {"x": xs(1)})
    later = asyncio.create_task(batcher.infer({"x": xs(1)}, deadline=time.monotonic() + 30))
    with pytest.raises(DeadlineExceeded):  # the 50 ms default, not its own 30 s
        await asyncio.wait_for(later, timeout=5)
    sooner = asyncio.create_task(batcher.infer({"x": xs(1)}, deadline=time.monotonic() + 0.01))
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(sooner, timeout=5)
    gated.gate.set()
    await first
    await batcher.stop()


async def test_full_queue_rejects_with_overloaded_and_retry_after(linear):
    gated = GatedSession(linear)
    stats = ModelStats("m", 1)
    batcher = await started(gated, policy_=policy(max_queue_size=2), stats=stats)
    first = await hold_first(batcher, gated, {"x": xs(1)})
    queued = [asyncio.create_task(batcher.infer({"x": xs(1)})) for _ in range(2)]
    await until(lambda: batcher.queue_depth == 2)
    with pytest.raises(Overloaded) as err:
        await batcher.infer({"x": xs(1)})
    assert err.value.retry_after is not None and err.value.retry_after >= 0.05
    assert err.value.http_status == 503
    gated.gate.set()
    await asyncio.gather(first, *queued)
    assert stats.snapshot().fail_count == 1
    await batcher.stop()


async def test_request_the_runtime_rejects_fails_alone_inside_a_batch(gather):
    gated = GatedSession(gather)
    stats = ModelStats("m", 1)
    batcher = await started(gated, stats=stats)
    first = await hold_first(batcher, gated, {"idx": np.array([[1]])})
    indices = [np.array([[0]]), np.array([[99], [1]]), np.array([[3], [2]])]
    tasks = [asyncio.create_task(batcher.infer({"idx": i})) for i in indices]
    await until(lambda: batcher.queue_depth == 3)
    gated.gate.set()
    good0, bad, good2 = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(bad, FerryError) and "99" in str(bad)
    np.testing.assert_array_equal(good0.outputs["y"], TABLE[indices[0]])
    np.testing.assert_array_equal(good2.outputs["y"], TABLE[indices[2]])
    await first
    assert len(gated.seen) == 5  # held batch, failed batch of 3, then each alone
    assert gated.seen[1].shape == (5, 1)
    snap = stats.snapshot()
    assert (snap.success_count, snap.fail_count) == (3, 1)
    await batcher.stop()


async def test_requests_with_other_inner_shapes_are_not_concatenated(linear):
    gated = GatedSession(linear)
    stats = ModelStats("m", 1)
    batcher = await started(gated, stats=stats)
    first = await hold_first(batcher, gated, {"x": xs(1)})
    good_a, good_b = xs(1), xs(2)
    wrong = RNG.standard_normal((1, 5)).astype(np.float32)  # inner dim the model rejects
    tasks = [asyncio.create_task(batcher.infer({"x": x})) for x in (good_a, wrong, good_b)]
    await until(lambda: batcher.queue_depth == 3)
    gated.gate.set()
    ra, bad, rb = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(bad, FerryError)
    assert_linear(good_a, ra)
    assert_linear(good_b, rb)
    assert ra.batch_size == rb.batch_size == 3
    await first
    await batcher.stop()


async def test_high_priority_request_runs_before_queued_low_priority_ones(linear):
    gated = GatedSession(linear)
    pol = policy(priority_levels=2, default_priority_level=2)
    batcher = await started(gated, max_batch_size=1, policy_=pol)
    first = await hold_first(batcher, gated, {"x": np.full((1, 4), 0, np.float32)})
    lows = [
        asyncio.create_task(batcher.infer({"x": np.full((1, 4), v, np.float32)})) for v in (1, 2, 3)
    ]
    await until(lambda: batcher.queue_depth == 3)
    high = asyncio.create_task(batcher.infer({"x": np.full((1, 4), 9, np.float32)}, priority=1))
    await until(lambda: batcher.queue_depth == 4)
    gated.gate.set()
    await asyncio.gather(first, high, *lows)
    assert [float(s[0, 0]) for s in gated.seen] == [0, 9, 1, 2, 3]
    # past the model's levels: the default level, as in Triton; a negative one is refused
    await batcher.infer({"x": xs(1)}, priority=3)
    with pytest.raises(InvalidInput):
        await batcher.infer({"x": xs(1)}, priority=-1)
    await batcher.stop()


async def test_each_priority_level_has_its_own_queue_bound(linear):
    """One bound for every level let low-priority traffic lock the high-priority
    requests out ("queue is full"), where Triton gives each level its own."""
    gated = GatedSession(linear)
    pol = policy(priority_levels=2, default_priority_level=2, max_queue_size=2)
    batcher = await started(gated, max_batch_size=1, policy_=pol)
    first = await hold_first(batcher, gated, {"x": xs(1)})
    lows = [asyncio.create_task(batcher.infer({"x": xs(1)})) for _ in range(2)]
    await until(lambda: batcher.queue_depth == 2)
    with pytest.raises(Overloaded, match="priority level 2"):
        await batcher.infer({"x": xs(1)})
    high = asyncio.create_task(batcher.infer({"x": xs(1)}, priority=1))
    await until(lambda: batcher.queue_depth == 3)
    gated.gate.set()
    await asyncio.gather(first, high, *lows)
    await batcher.stop()


async def test_bad_batch_dimension_is_invalid_input(linear):
    batcher = await started(linear, max_batch_size=4)
    with pytest.raises(InvalidInput):
        await batcher.infer({"x": xs(5)})
    with pytest.raises(InvalidInput):
        await batcher.infer({"x": np.zeros((0, 4), np.float32)})
    await batcher.stop()


async def test_cancelled_request_is_skipped_and_the_scheduler_keeps_running(linear):
    gated = GatedSession(linear)
    batcher = await started(gated)
    first = await hold_first(batcher, gated, {"x": xs(1)})
    gone = asyncio.create_task(batcher.infer({"x": xs(1)}))
    kept_x = xs(1)
    kept = asyncio.create_task(batcher.infer({"x": kept_x}))
    await until(lambda: batcher.queue_depth == 2)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert batcher.queue_depth == 1
    gated.gate.set()
    assert_linear(kept_x, await kept)
    await first
    later = xs(2)
    assert_linear(later, await batcher.infer({"x": later}))
    await batcher.stop()


async def test_stop_with_drain_finishes_queued_work_then_rejects(linear):
    gated = GatedSession(linear)
    batcher = await started(gated)
    first = await hold_first(batcher, gated, {"x": xs(1)})
    inputs = [xs(1) for _ in range(3)]
    tasks = [asyncio.create_task(batcher.infer({"x": x})) for x in inputs]
    await until(lambda: batcher.queue_depth == 3)
    stopping = asyncio.create_task(batcher.stop(drain=True))
    await asyncio.sleep(0.01)
    assert not stopping.done()
    with pytest.raises(ModelNotReady):
        await batcher.infer({"x": xs(1)})
    gated.gate.set()
    await stopping
    for x, t in zip(inputs, tasks, strict=True):
        assert_linear(x, t.result())
    await first
    with pytest.raises(ModelNotReady):
        await batcher.infer({"x": xs(1)})


async def test_stop_without_drain_fails_queued_requests_with_model_not_ready(linear):
    gated = GatedSession(linear)
    batcher = await started(gated)
    first = await hold_first(batcher, gated, {"x": xs(1)})
    tasks = [asyncio.create_task(batcher.infer({"x": xs(1)})) for _ in range(2)]
    await until(lambda: batcher.queue_depth == 2)
    stopping = asyncio.create_task(batcher.stop(drain=False))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, ModelNotReady) for r in results)
    gated.gate.set()
    await stopping
    assert (await first).outputs["y"].shape == (1, 3)  # the batch in flight still completes


async def test_each_session_runs_its_own_batch_at_the_same_time(tmp_path):
    path = build_linear(tmp_path / "two.onnx")
    gated = [
        GatedSession(load_session("onnxruntime", path, RuntimeOptions(threads=1))) for _ in range(2)
    ]
    stats = ModelStats("m", 1)
    batcher = DynamicBatcher(
        model="m", version=1, sessions=gated, max_batch_size=8, policy=policy(), stats=stats
    )
    await batcher.start()
    a, b = xs(1), xs(3)
    task_a = asyncio.create_task(batcher.infer({"x": a}))
    await until(lambda: sum(g.entered.is_set() for g in gated) == 1)
    task_b = asyncio.create_task(batcher.infer({"x": b}))
    # both sessions are inside run() at once: the second batch did not wait for the first
    await until(lambda: all(g.entered.is_set() for g in gated))
    for g in gated:
        g.gate.set()
    assert_linear(a, await task_a)
    assert_linear(b, await task_b)
    await batcher.stop()
    for g in gated:
        g.close()


async def test_a_held_batch_is_dispatched_before_its_earliest_deadline(linear):
    batcher = await started(linear, policy_=policy(max_queue_delay_us=20_000_000))
    x = xs(1)
    result = await asyncio.wait_for(
        batcher.infer({"x": x}, deadline=time.monotonic() + 0.5), timeout=10
    )
    assert_linear(x, result)
    await batcher.stop()


async def test_an_idle_model_dispatches_a_lone_request_at_once_despite_the_delay(linear):
    # a 20 s delay would be waited out in full by a batcher that holds for company
    batcher = await started(linear, policy_=policy(max_queue_delay_us=20_000_000))
    result = await asyncio.wait_for(batcher.infer({"x": xs(1)}), timeout=5)
    assert result.batch_size == 1
    await batcher.stop()


async def test_requests_arriving_during_a_run_form_the_next_batch(linear):
    gated = GatedSession(linear)
    batcher = await started(gated, policy_=policy(max_queue_delay_us=20_000_000))
    first = await hold_first(batcher, gated, {"x": xs(1)})
    rest = [asyncio.create_task(batcher.infer({"x": xs(1)})) for _ in range(3)]
    await until(lambda: batcher.queue_depth == 3)
    gated.gate.set()
    results = await asyncio.wait_for(asyncio.gather(first, *rest), timeout=5)
    assert [r.batch_size for r in results] == [1, 3, 3, 3]
    assert [len(x) for x in gated.seen] == [1, 3]
    await batcher.stop()


async def test_every_request_gets_one_answer_under_dispatch_at_idle(linear):
    batcher = await started(
        linear, policy_=policy(max_queue_delay_us=500, preferred_batch_sizes=[4])
    )
    answers = 0

    async def client(n: int) -> None:
        nonlocal answers
        for _ in range(n):
            x = xs(1)
            result = await batcher.infer({"x": x})
            np.testing.assert_allclose(result.outputs["y"], x @ W + B, rtol=1e-5, atol=1e-5)
            answers += 1

    await asyncio.wait_for(asyncio.gather(*(client(25) for _ in range(8))), timeout=30)
    assert answers == 200
    await batcher.stop()


class ThreadRecordingSession:
    """A real session that notes which thread each run happened on."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.backend = inner.backend
        self.inputs = inner.inputs
        self.outputs = inner.outputs
        self.threads: list[int] = []
        self.sizes: list[int] = []

    def run(self, inputs, outputs=None):
        self.threads.append(threading.get_ident())
        self.sizes.append(len(next(iter(inputs.values()))))
        return self.inner.run(inputs, outputs)

    def close(self) -> None:
        self.inner.close()


async def inline_batcher(session, inline_us: float) -> DynamicBatcher:
    batcher = DynamicBatcher(
        model="m",
        version=1,
        sessions=[session],
        max_batch_size=8,
        policy=policy(),
        stats=ModelStats("m", 1),
        inline_us=inline_us,
    )
    await batcher.start()
    return batcher


async def test_a_tiny_model_runs_lone_requests_on_the_loop_once_it_has_warmed_up(linear):
    from shared.runtimes.inline import WARMUP_RUNS

    recorded = ThreadRecordingSession(linear)
    # a budget no run of this model reaches, so the test never depends on the clock
    batcher = await inline_batcher(recorded, inline_us=1e9)
    loop_thread = threading.get_ident()
    for _ in range(WARMUP_RUNS + 4):
        x = xs(1)
        assert_linear(x, await batcher.infer({"x": x}))
    assert loop_thread not in recorded.threads[:WARMUP_RUNS]
    assert recorded.threads[WARMUP_RUNS:] == [loop_thread] * 4
    await batcher.stop()


async def test_a_burst_runs_a_few_in_place_then_batches_on_the_worker(linear):
    from cloud.batcher import IN_PLACE_PER_TURN
    from shared.runtimes.inline import WARMUP_RUNS

    recorded = ThreadRecordingSession(linear)
    batcher = await inline_batcher(recorded, inline_us=1e9)
    for _ in range(WARMUP_RUNS):
        await batcher.infer({"x": xs(1)})
    loop_thread = threading.get_ident()
    inputs = [xs(1) for _ in range(12)]
    results = await asyncio.wait_for(
        asyncio.gather(*(batcher.infer({"x": x}) for x in inputs)), timeout=10
    )
    for x, result in zip(inputs, results, strict=True):
        assert_linear(x, result)
    burst = list(zip(recorded.threads[WARMUP_RUNS:], recorded.sizes[WARMUP_RUNS:], strict=True))
    on_loop = [size for thread, size in burst if thread == loop_thread]
    on_worker = [size for thread, size in burst if thread != loop_thread]
    assert on_loop == [1] * IN_PLACE_PER_TURN  # a flood does not hold the loop run after run
    assert sum(on_worker) == 12 - IN_PLACE_PER_TURN and max(on_worker) > 1  # the rest batch
    await batcher.stop()


async def test_the_hand_off_to_a_worker_is_measured_and_raises_the_inline_budget(linear):
    from shared.runtimes.inline import HOP_CAP

    recorded = ThreadRecordingSession(linear)
    # 1 us: below what any thread hand-off costs, so every hop measured raises it
    batcher = await inline_batcher(recorded, inline_us=1.0)
    for _ in range(4):
        await batcher.infer({"x": xs(1)})
    assert threading.get_ident() not in recorded.threads  # all four ran on the worker
    assert 1.0 < batcher._gate.budget_us <= HOP_CAP * 1.0
    await batcher.stop()


async def test_without_an_inline_budget_no_run_happens_on_the_loop(linear):
    recorded = ThreadRecordingSession(linear)
    batcher = await inline_batcher(recorded, inline_us=0)
    for _ in range(20):
        await batcher.infer({"x": xs(1)})
    assert threading.get_ident() not in recorded.threads
    await batcher.stop()


# ---- the lone-request session --------------------------------------------------------------
async def lone_batcher(instances, lone, activity=None) -> DynamicBatcher:
    from cloud.workers import NodeActivity

    batcher = DynamicBatcher(
        model="m",
        version=1,
        sessions=instances,
        max_batch_size=8,
        policy=policy(max_queue_delay_us=20_000_000),
        stats=ModelStats("m", 1),
        lone=lone,
        activity=activity or NodeActivity(),
    )
    await batcher.start()
    return batcher


async def test_a_lone_request_on_an_idle_node_runs_on_the_lone_session(tmp_path):
    path = build_linear(tmp_path / "lone.onnx")
    instance = ThreadRecordingSession(load_session("onnxruntime", path, RuntimeOptions(threads=1)))
    lone = ThreadRecordingSession(load_session("onnxruntime", path, RuntimeOptions(threads=2)))
    batcher = await lone_batcher([instance], lone)
    for _ in range(3):
        x = xs(1)
        assert_linear(x, await batcher.infer({"x": x}))
    assert (lone.sizes, instance.sizes, batcher.lone_runs) == ([1, 1, 1], [], 3)
    await batcher.stop()
    instance.close()
    lone.close()


async def test_requests_behind_a_lone_run_wait_for_it_and_form_one_batch_on_an_instance(
    tmp_path,
):
    path = build_linear(tmp_path / "lone.onnx")
    instances = [
        ThreadRecordingSession(load_session("onnxruntime", path, RuntimeOptions(threads=1)))
        for _ in range(2)
    ]
    lone = GatedSession(load_session("onnxruntime", path, RuntimeOptions(threads=2)))
    batcher = await lone_batcher(instances, lone)
    first = await hold_first(batcher, lone, {"x": xs(1)})
    rest = [asyncio.create_task(batcher.infer({"x": xs(1)})) for _ in range(3)]
    await until(lambda: batcher.queue_depth == 3)
    assert all(not i.sizes for i in instances)  # the lone run holds every instance
    lone.gate.set()
    results = await asyncio.wait_for(asyncio.gather(first, *rest), timeout=5)
    assert [r.batch_size for r in results] == [1, 3, 3, 3]
    assert sorted(size for i in instances for size in i.sizes) == [3]
    await batcher.stop()
    for s in [*instances, lone]:
        s.close()


async def test_no_lone_run_while_another_model_runs_on_the_node(tmp_path):
    from cloud.workers import NodeActivity

    path = build_linear(tmp_path / "lone.onnx")
    activity = NodeActivity()
    activity.running = 1  # another model's batch is running
    instance = ThreadRecordingSession(load_session("onnxruntime", path, RuntimeOptions(threads=1)))
    lone = ThreadRecordingSession(load_session("onnxruntime", path, RuntimeOptions(threads=2)))
    batcher = await lone_batcher([instance], lone, activity)
    x = xs(1)
    assert_linear(x, await batcher.infer({"x": x}))
    assert (instance.sizes, lone.sizes, activity.running) == ([1], [], 1)
    await batcher.stop()
    instance.close()
    lone.close()


async def test_preserve_ordering_holds_an_answer_until_every_earlier_one_is_out(linear):
    """preserve_ordering was read and dropped: with two instances a short request that
    came second was answered before a long one that came first."""
    first_instance, second_instance = GatedSession(linear), GatedSession(linear)
    batcher = DynamicBatcher(
        model="m",
        version=1,
        sessions=[first_instance, second_instance],
        max_batch_size=1,
        policy=policy(preserve_ordering=True),
        stats=ModelStats("m", 1),
    )
    await batcher.start()
    a = asyncio.create_task(batcher.infer({"x": xs(1)}))
    await until(lambda: first_instance.entered.is_set() or second_instance.entered.is_set())
    held, other = (
        (first_instance, second_instance)
        if first_instance.entered.is_set()
        else (second_instance, first_instance)
    )
    other.gate.set()
    b = asyncio.create_task(batcher.infer({"x": xs(1)}))
    await until(lambda: bool(other.seen))
    await asyncio.sleep(0.2)  # b's run is long over
    assert not b.done() and not a.done()
    held.gate.set()
    done, _ = await asyncio.wait({a, b}, return_when=asyncio.FIRST_COMPLETED)
    assert a in done
    await asyncio.gather(a, b)
    await batcher.stop()


async def _two_sessions(tmp_path, delay_us: int) -> tuple[DynamicBatcher, list[GatedSession]]:
    path = build_linear(tmp_path / "two.onnx")
    gated = [
        GatedSession(load_session("onnxruntime", path, RuntimeOptions(threads=1))) for _ in range(2)
    ]
    batcher = DynamicBatcher(
        model="m",
        version=1,
        sessions=gated,
        max_batch_size=8,
        policy=policy(max_queue_delay_us=delay_us),
        stats=ModelStats("m", 1),
    )
    await batcher.start()
    return batcher, gated


async def _end_two(batcher: DynamicBatcher, gated: list[GatedSession], busy) -> None:
    for g in gated:
        g.gate.set()
    await busy
    await batcher.stop()
    for g in gated:
        g.close()


async def test_with_a_batch_in_flight_a_partial_batch_waits_the_delay_for_company(tmp_path):
    # (one session busy, the other idle: the queue delay is what makes a batch here)
    batcher, gated = await _two_sessions(tmp_path, delay_us=300_000)
    busy = asyncio.create_task(batcher.infer({"x": xs(1)}))
    await until(lambda: sum(g.entered.is_set() for g in gated) == 1)
    idle = next(g for g in gated if not g.entered.is_set())
    idle.gate.set()
    rest = []
    for _ in range(3):
        rest.append(asyncio.create_task(batcher.infer({"x": xs(1)})))
        await asyncio.sleep(0.02)
    results = await asyncio.wait_for(asyncio.gather(*rest), timeout=5)
    assert [len(x) for x in idle.seen] == [3]  # one batch, not three runs
    assert all(r.batch_size == 3 for r in results)
    await _end_two(batcher, gated, busy)


async def test_a_batch_held_for_company_goes_before_its_members_deadline(tmp_path):
    batcher, gated = await _two_sessions(tmp_path, delay_us=20_000_000)
    busy = asyncio.create_task(batcher.infer({"x": xs(1)}))
    await until(lambda: sum(g.entered.is_set() for g in gated) == 1)
    next(g for g in gated if not g.entered.is_set()).gate.set()
    x = xs(1)
    result = await asyncio.wait_for(
        batcher.infer({"x": x}, deadline=time.monotonic() + 0.5), timeout=5
    )
    assert_linear(x, result)  # an answer: not held the 20 s delay, nor to a 504
    await _end_two(batcher, gated, busy)
