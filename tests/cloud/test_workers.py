"""The node's turns: one batch at a time over all models, round robin, each turn taking
what queued meanwhile; real ONNX Runtime sessions held in flight by a gate."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from cloud.batcher import DynamicBatcher
from cloud.stats import ModelStats
from cloud.workers import NodeActivity
from shared.errors import DeadlineExceeded
from shared.runtimes import RuntimeOptions, load_session
from tests.cloud.test_batcher import GatedSession, assert_linear, build_linear, policy, until, xs


class Logged(GatedSession):
    """A gated session that also writes its model's name to a shared run log."""

    def __init__(self, inner, name: str, log: list[tuple[str, int]]) -> None:
        super().__init__(inner)
        self.name, self.log = name, log

    def run(self, inputs, outputs=None):
        self.log.append((self.name, len(next(iter(inputs.values())))))
        return super().run(inputs, outputs)


@pytest.fixture
def node(tmp_path):
    """Three gated models; the gates start open unless a test closes them."""
    path = build_linear(tmp_path / "linear.onnx")
    log: list[tuple[str, int]] = []
    sessions = {
        name: Logged(load_session("onnxruntime", path, RuntimeOptions(threads=1)), name, log)
        for name in ("a", "b", "c")
    }
    yield sessions, log
    for s in sessions.values():
        s.close()


async def batchers(sessions, activity: NodeActivity) -> dict[str, DynamicBatcher]:
    found = {}
    for name, session in sessions.items():
        b = DynamicBatcher(
            model=name,
            version=1,
            sessions=[session],
            max_batch_size=8,
            policy=policy(),
            stats=ModelStats(name, 1),
            activity=activity,
        )
        await b.start()
        found[name] = b
    return found


async def holding_a(sessions) -> tuple[NodeActivity, dict[str, DynamicBatcher], asyncio.Task]:
    """A node in turns whose model ``a`` has a batch held in flight."""
    activity = NodeActivity(turns=True)
    found = await batchers(sessions, activity)
    held = asyncio.create_task(found["a"].infer({"x": xs(1)}))
    assert await asyncio.to_thread(sessions["a"].entered.wait, 5)
    return activity, found, held


async def stop_all(found: dict[str, DynamicBatcher]) -> None:
    for b in found.values():
        await b.stop()


async def test_with_turns_another_models_batch_waits_and_then_takes_all_that_queued(node):
    sessions, log = node
    activity, found, first = await holding_a(sessions)
    inputs = [xs(1) for _ in range(3)]
    waiting = [asyncio.create_task(found["b"].infer({"x": x})) for x in inputs]
    await until(lambda: found["b"].queue_depth == 3)
    await asyncio.sleep(0.05)
    assert not sessions["b"].entered.is_set()  # the node is a's until its batch ends
    assert activity.holder is found["a"] and list(activity.line) == [found["b"]]
    sessions["a"].gate.set()
    sessions["b"].gate.set()
    await first
    for x, result in zip(inputs, await asyncio.gather(*waiting), strict=True):
        assert_linear(x, result)
    assert log == [("a", 1), ("b", 3)]  # one turn for b, with everything it queued
    assert activity.holder is None and not activity.line
    await stop_all(found)


async def test_turns_go_round_robin_so_a_busy_model_waits_behind_the_others(node):
    sessions, log = node
    _, found, held = await holding_a(sessions)
    tasks = [asyncio.create_task(found["b"].infer({"x": xs(1)}))]
    await until(lambda: found["b"].queue_depth == 1)
    tasks += [asyncio.create_task(found["a"].infer({"x": xs(1)})) for _ in range(2)]
    tasks.append(asyncio.create_task(found["c"].infer({"x": xs(1)})))
    await until(lambda: found["c"].queue_depth == 1 and found["a"].queue_depth == 2)
    for s in sessions.values():
        s.gate.set()
    await asyncio.gather(held, *tasks)
    # a's second batch comes after b and c, who asked while its first ran
    assert log == [("a", 1), ("b", 1), ("c", 1), ("a", 2)]
    await stop_all(found)


async def test_without_turns_two_models_batches_run_side_by_side(node):
    sessions, _ = node
    found = await batchers(sessions, NodeActivity(turns=False))
    tasks = [asyncio.create_task(found[m].infer({"x": xs(1)})) for m in ("a", "b")]
    assert await asyncio.to_thread(sessions["a"].entered.wait, 5)
    assert await asyncio.to_thread(sessions["b"].entered.wait, 5)  # both in flight at once
    for s in sessions.values():
        s.gate.set()
    await asyncio.gather(*tasks)
    await stop_all(found)


async def test_a_model_whose_requests_expire_in_line_passes_the_turn_on(node):
    sessions, log = node
    activity, found, held = await holding_a(sessions)
    doomed = asyncio.create_task(found["b"].infer({"x": xs(1)}, deadline=time.monotonic() + 0.05))
    later = asyncio.create_task(found["c"].infer({"x": xs(1)}))
    await until(lambda: found["c"].queue_depth == 1)
    with pytest.raises(DeadlineExceeded):
        await doomed  # expired in line: answered, and out of the line
    sessions["a"].gate.set()
    sessions["c"].gate.set()
    await asyncio.gather(held, later)
    assert [name for name, _ in log] == ["a", "c"]
    assert activity.holder is None and not activity.line
    await stop_all(found)


async def test_every_request_gets_one_answer_when_many_models_take_turns(node):
    sessions, log = node
    for s in sessions.values():
        s.gate.set()
    activity = NodeActivity(turns=True)
    found = await batchers(sessions, activity)
    inputs = [(name, xs(1)) for _ in range(40) for name in found]
    results = await asyncio.gather(*(found[n].infer({"x": x}) for n, x in inputs))
    for (_, x), result in zip(inputs, results, strict=True):
        assert_linear(x, result)
    assert sum(n for _, n in log) == len(inputs)
    assert activity.running == 0 and activity.holder is None and not activity.line
    await stop_all(found)


def test_the_line_skips_a_model_that_no_longer_wants_a_turn() -> None:
    class Taker:
        def __init__(self, wants: bool) -> None:
            self.wants, self.woken = wants, 0

        def wants_turn(self) -> bool:
            return self.wants

        def wake_for_turn(self) -> None:
            self.woken += 1

    activity = NodeActivity(turns=True)
    first, gone, next_ = Taker(True), Taker(False), Taker(True)
    assert activity.take(first)
    assert not activity.take(gone) and not activity.take(next_)
    activity.release(first)
    assert (gone.woken, next_.woken) == (0, 1) and list(activity.line) == [next_]
    assert not activity.take(first)  # next_ was in line first
    assert activity.take(next_)
    assert np.all([activity.holder is next_, list(activity.line) == [first]])
