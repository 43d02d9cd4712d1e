"""IdempotencyCache: one run per key, shared by duplicates; errors are not cached."""

from __future__ import annotations

import asyncio

import pytest

from shared.aio.idempotency import IdempotencyCache
from shared.errors import DeadlineExceeded, InternalError, InvalidInput
from shared.idempotency import idempotency_key


class Counter:
    """A real coroutine factory that counts its runs and can be held open."""

    def __init__(self, fail: bool = False) -> None:
        self.runs = 0
        self.fail = fail
        self.release = asyncio.Event()

    async def __call__(self) -> str:
        self.runs += 1
        await self.release.wait()
        if self.fail:
            raise InternalError("runtime failed")
        return f"result-{self.runs}"


async def test_a_duplicate_in_flight_awaits_the_same_run():
    cache: IdempotencyCache[str] = IdempotencyCache(60, 16)
    work = Counter()
    first = asyncio.ensure_future(cache.run("k", work))
    second = asyncio.ensure_future(cache.run("k", work))
    await asyncio.sleep(0)
    work.release.set()
    assert await first == ("result-1", False)
    assert await second == ("result-1", True)
    assert await cache.run("k", work) == ("result-1", True)  # after completion: cached
    assert work.runs == 1


async def test_errors_are_shared_in_flight_but_not_cached():
    cache: IdempotencyCache[str] = IdempotencyCache(60, 16)
    failing = Counter(fail=True)
    first = asyncio.ensure_future(cache.run("k", failing))
    second = asyncio.ensure_future(cache.run("k", failing))
    await asyncio.sleep(0)  # both in flight: the second shares the first's run
    failing.release.set()
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert all(isinstance(r, InternalError) for r in results) and failing.runs == 1
    fine = Counter()
    fine.release.set()
    assert await cache.run("k", fine) == ("result-1", False)  # runs afresh


async def test_a_run_that_needs_no_wait_is_answered_in_place_and_cached():
    cache: IdempotencyCache[str] = IdempotencyCache(60, 16)
    work = Counter()
    work.release.set()  # the run will not wait: it ends before run() returns
    assert await cache.run("k", work) == ("result-1", False)
    assert await cache.run("k", work) == (
        "result-1",
        True,
    )  # settled at once, not a loop turn later
    assert work.runs == 1


async def test_entries_expire_after_the_ttl():
    cache: IdempotencyCache[str] = IdempotencyCache(0.0, 16)
    work = Counter()
    work.release.set()
    assert (await cache.run("k", work))[1] is False
    assert (await cache.run("k", work))[1] is False  # expired at once: ran again
    assert work.runs == 2


async def test_an_entry_past_its_ttl_is_run_afresh_though_nothing_swept_it():
    cache: IdempotencyCache[str] = IdempotencyCache(0.05, 16)
    work = Counter()
    work.release.set()
    assert await cache.run("k", work) == ("result-1", False)
    assert await cache.run("k", work) == ("result-1", True)  # within the ttl: shared
    await asyncio.sleep(0.1)  # (no other key inserted: only the lookup can see it expired)
    assert await cache.run("k", work) == ("result-2", False)


async def test_a_client_that_goes_away_does_not_cancel_the_run():
    cache: IdempotencyCache[str] = IdempotencyCache(60, 16)
    work = Counter()
    first = asyncio.ensure_future(cache.run("k", work))
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    work.release.set()
    assert await cache.run("k", work) == ("result-1", True)  # the retry gets its result
    assert work.runs == 1


async def test_the_cache_is_a_bounded_lru():
    cache: IdempotencyCache[str] = IdempotencyCache(60, 2)
    work = Counter()
    work.release.set()
    for key in ("a", "b", "c"):
        await cache.run(key, work)
    assert len(cache) == 2
    assert (await cache.run("a", work))[1] is False  # evicted: runs again
    assert (await cache.run("c", work))[1] is True


@pytest.mark.parametrize("bad", ["", "x" * 129, 12, ["k"]])
def test_keys_must_be_short_strings(bad):
    with pytest.raises(InvalidInput, match="idempotency_key"):
        idempotency_key({"idempotency_key": bad})
    assert idempotency_key({}) is None and idempotency_key({"idempotency_key": "ok"}) == "ok"


async def test_a_reused_key_with_other_inputs_is_a_conflict_not_another_answer():
    from shared.errors import IdempotencyConflict

    cache: IdempotencyCache[str] = IdempotencyCache(60, 16)
    work = Counter()
    work.release.set()
    assert await cache.run("k", work, b"inputs-1") == ("result-1", False)
    with pytest.raises(IdempotencyConflict):
        await cache.run("k", work, b"inputs-2")
    assert await cache.run("k", work, b"inputs-1") == ("result-1", True)


async def test_the_cache_is_bounded_by_the_bytes_of_its_answers():
    from shared.aio.idempotency import ENTRY_OVERHEAD

    each = 40 + ENTRY_OVERHEAD  # (an entry's own cost is counted too)
    cache: IdempotencyCache[str] = IdempotencyCache(
        60, 1000, max_bytes=2 * each + 20, sizeof=lambda r: 40
    )
    work = Counter()
    work.release.set()
    for key in ("a", "b", "c"):
        await cache.run(key, work)
    assert len(cache) == 2 and cache.bytes == 2 * each  # the oldest went to stay under
    assert (await cache.run("a", work))[1] is False
    huge: IdempotencyCache[str] = IdempotencyCache(60, 1000, max_bytes=10, sizeof=lambda r: 40)
    await huge.run("x", work)
    assert len(huge) == 0 and huge.bytes == 0  # bigger than the cache: not kept


async def test_a_cached_answer_owns_its_outputs_and_lets_the_batch_it_came_from_go():
    """A batched run hands each request a view of the batch's output: cached as a view,
    a 1 MiB keyed answer had pinned its 8 MiB batch while the bound counted 1 MiB."""
    import gc
    import weakref

    import numpy as np

    from shared.aio.idempotency import owned_response, response_bytes
    from shared.messages import InferResponse
    from shared.tensors import Tensor

    batch = np.ones((8, 1 << 18), np.float32)
    gone = weakref.ref(batch)
    made = [InferResponse("m", [Tensor("y", "FP32", batch[2:3])])]
    del batch

    async def work() -> InferResponse:
        return made.pop()

    cache: IdempotencyCache[InferResponse] = IdempotencyCache(
        60, 10, sizeof=response_bytes, compact=owned_response
    )
    answer, duplicate = await cache.run("k", work)
    assert answer.outputs[0].data.shape == (1, 1 << 18) and not duplicate
    del answer
    gc.collect()
    assert gone() is None  # only the request's own row is kept
    again, duplicate = await cache.run("k", lambda: None)  # type: ignore[arg-type,return-value]
    assert duplicate and again.outputs[0].data.shape == (1, 1 << 18)
    assert again.outputs[0].data.base is None and float(again.outputs[0].data[0, 5]) == 1.0


async def test_expired_entries_are_let_go_not_kept_until_the_bounds_push_them_out():
    """The ttl had bounded nothing: 3000 keys with a 10 ms ttl were all still held."""
    import time

    cache: IdempotencyCache[str] = IdempotencyCache(0.01, 4096)
    work = Counter()
    work.release.set()
    for i in range(300):
        await cache.run(f"k{i}", work)
    time.sleep(0.05)
    await cache.run("last", work)
    assert len(cache) == 1 and cache.bytes == cache.sizeof("") + _overhead()


def _overhead() -> int:
    from shared.aio.idempotency import ENTRY_OVERHEAD

    return ENTRY_OVERHEAD


async def test_keys_are_scoped_by_principal_and_checked_against_the_inputs(tmp_path):
    import numpy as np

    from cloud.dataplane import DataPlane
    from shared.errors import IdempotencyConflict
    from shared.messages import InferRequest
    from shared.repository import ModelRepository
    from shared.tensors import Tensor
    from tests.support import write_linear_model

    write_linear_model(tmp_path / "m" / "1" / "model.onnx", seed=1)
    dp = DataPlane(ModelRepository(tmp_path), "n")
    await dp.load("m")

    def request(value: float):
        x = np.full((1, 4), value, np.float32)
        return InferRequest(inputs=[Tensor.from_array("x", x)], parameters={"idempotency_key": "k"})

    alice = await dp.infer("m", request(1.0), principal="alice")
    bob = await dp.infer("m", request(2.0), principal="bob")  # same key, another caller
    assert not np.array_equal(alice.outputs[0].data, bob.outputs[0].data)
    assert "duplicate" not in bob.parameters
    again = await dp.infer("m", request(1.0), principal="alice")
    assert again.parameters.get("duplicate") is True
    with pytest.raises(IdempotencyConflict):
        await dp.infer("m", request(3.0), principal="alice")
    await dp.close()


def test_the_mqtt_sender_is_the_broker_user_in_its_reply_topic():
    """Stable across an agent's restart (its client id is not), so a resend after a
    crash still finds its key; anonymous clients share one scope."""
    from shared.mqtt import reply_principal, reply_topic

    assert reply_principal(reply_topic("ferry-edge-1a2b", "edge-7")) == "edge-7"
    assert reply_principal(reply_topic("ferry-edge-9z9z", "edge-7")) == "edge-7"
    assert reply_principal(reply_topic("ferry-edge-1a2b")) == ""
    assert reply_principal(None) == "" and reply_principal("elsewhere/x/y") == ""


async def test_a_duplicate_waits_within_its_own_deadline_and_outlives_a_shorter_one():
    import time

    from shared.errors import DeadlineExceeded

    cache: IdempotencyCache[str] = IdempotencyCache(60, 16)
    work = Counter()
    first = asyncio.ensure_future(cache.run("k", work, deadline=time.monotonic() + 60))
    await asyncio.sleep(0)
    with pytest.raises(DeadlineExceeded, match="earlier request with this"):
        await cache.run("k", work, deadline=time.monotonic() + 0.02)  # not a late answer
    work.release.set()
    assert await first == ("result-1", False)


async def missed() -> str:
    """A run whose own, shorter deadline passes while it waits."""
    await asyncio.sleep(0.02)
    raise DeadlineExceeded("deadline passed in queue")


@pytest.mark.parametrize("left_s", [60.0, None])
async def test_a_duplicate_with_time_left_runs_afresh_when_the_run_missed_its_deadline(left_s):
    import time

    cache: IdempotencyCache[str] = IdempotencyCache(60, 16)
    short = asyncio.ensure_future(cache.run("k", missed))
    await asyncio.sleep(0)
    again = Counter()
    again.release.set()
    deadline = None if left_s is None else time.monotonic() + left_s
    assert await cache.run("k", again, deadline=deadline) == ("result-1", False)
    with pytest.raises(DeadlineExceeded):
        await short
    assert again.runs == 1
