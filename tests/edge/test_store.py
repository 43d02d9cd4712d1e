import os
import signal
import subprocess
import sys
import textwrap

from edge.store import DeferredStore


def test_puts_survive_kill_9_of_the_writer(tmp_path):
    db = tmp_path / "deferred.db"
    child = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(os.getcwd())!r})
        from edge.store import DeferredStore
        s = DeferredStore({str(db)!r})
        for i in range(20):
            s.put("m", b"payload-%d" % i, request_id=f"r{{i}}", created_wall=time.time(), expires_wall=None)
        print("ok", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ok"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    store = DeferredStore(db)
    items = store.pending(limit=100)
    assert [i.request_id for i in items] == [f"r{i}" for i in range(20)]
    assert items[3].payload == b"payload-3"


def test_sending_rows_left_by_a_crash_return_to_pending(tmp_path):
    store = DeferredStore(tmp_path / "d.db")
    store.put("m", b"x", request_id="a", created_wall=1.0, expires_wall=None)
    store.mark_sending("a")
    assert store.pending() == []
    store.close()
    reopened = DeferredStore(tmp_path / "d.db")
    assert [i.request_id for i in reopened.pending()] == ["a"]
    assert reopened.pending()[0].attempts == 1


def test_results_expiry_and_duplicates(tmp_path):
    store = DeferredStore(tmp_path / "d.db")
    store.put("m", b"x", request_id="a", created_wall=1.0, expires_wall=100.0)
    store.put(
        "m", b"y", request_id="a", created_wall=2.0, expires_wall=100.0
    )  # duplicate id ignored
    store.put("m", b"z", request_id="b", created_wall=1.0, expires_wall=10.0)
    assert store.expire(50.0) == ["b"]
    assert store.result("b").status == "expired" and "deadline" in store.result("b").error
    store.mark_sending("a")
    store.mark_delivered("a", b"answer", None)
    assert store.result("a").status == "delivered" and store.result("a").result == b"answer"
    assert store.result("nope") is None
    assert store.counts() == {"delivered": 1, "expired": 1}


def test_priority_follows_the_cloud_one_first_and_none_given_last(tmp_path):
    store = DeferredStore(tmp_path / "d.db")
    for i, priority in enumerate([0, 3, 1, 2, 0, 1]):
        store.put("m", b"x", request_id=f"r{i}", created_wall=float(i), expires_wall=None,
                  priority=priority)  # fmt: skip
    assert [i.request_id for i in store.pending()] == ["r2", "r5", "r3", "r1", "r0", "r4"]


def test_a_link_that_lets_a_request_down_is_not_its_attempt(tmp_path):
    store = DeferredStore(tmp_path / "d.db")
    store.put("m", b"x", request_id="a", created_wall=1.0, expires_wall=None)
    for _ in range(5):
        store.mark_sending("a")
        store.mark_pending("a")  # the link failed
    assert store.pending()[0].attempts == 0
    store.mark_sending("a")
    store.mark_pending("a", attempt=True)  # the cloud failed it
    assert store.pending()[0].attempts == 1


def test_the_store_is_bounded_and_refuses_past_it_with_overloaded(tmp_path):
    import pytest

    from shared.errors import Overloaded

    store = DeferredStore(tmp_path / "d.db", max_rows=3, max_bytes=10)
    for i in range(3):
        store.put("m", b"abc", request_id=f"r{i}", created_wall=1.0, expires_wall=None)
    with pytest.raises(Overloaded, match="deferred store is full"):
        store.put("m", b"a", request_id="r3", created_wall=1.0, expires_wall=None)
    store.mark_sending("r0")
    store.mark_delivered("r0", b"answer", None)  # answered rows do not count
    with pytest.raises(Overloaded):
        store.put("m", b"abcdefgh", request_id="r4", created_wall=1.0, expires_wall=None)
    store.put("m", b"abc", request_id="r5", created_wall=1.0, expires_wall=None)


def test_answers_kept_are_bounded_too_and_keep_no_request(tmp_path):
    # Answered rows kept their whole request for keep_results_s (8 days), unbounded.
    store = DeferredStore(tmp_path / "d.db", max_rows=3, max_bytes=100)
    for i in range(8):
        store.put("m", b"x" * 60, request_id=f"r{i}", created_wall=float(i), expires_wall=None)
        store.mark_sending(f"r{i}")
        store.mark_delivered(f"r{i}", b"a" * 30, None, now_wall=100.0 + i)
        held = store._db.execute(
            "SELECT COUNT(*), SUM(LENGTH(result) + LENGTH(payload)) FROM deferred"
        ).fetchone()
        assert held[0] <= 3 and held[1] <= 100 and (store._held_rows, store._held_bytes) == held
    kept = [i for i in range(8) if store.result(f"r{i}") is not None]
    assert 7 in kept and 0 not in kept and kept == sorted(kept)[-len(kept) :]
    assert store.result("r7").result == b"a" * 30


def test_the_answer_just_written_is_kept_and_the_first_answered_goes_first(tmp_path):
    # Trimming by when a request was deferred deleted the answer it had just stored
    # (deferred an hour ago, answered last): the app found no such request.
    store = DeferredStore(tmp_path / "d.db", max_rows=2, max_bytes=1000)
    for i, (created, answered) in enumerate(((50.0, 101.0), (60.0, 102.0), (1.0, 103.0))):
        store.put("m", b"x", request_id=f"r{i}", created_wall=created, expires_wall=None)
        store.mark_delivered(f"r{i}", b"a", None, now_wall=answered)
    assert store.result("r2") is not None and store.result("r0") is None
    store.put("m", b"x", request_id="big", created_wall=0.0, expires_wall=None)
    store.mark_delivered("big", b"b" * 5000, None, now_wall=104.0)  # over max_bytes alone
    assert store.result("big").result == b"b" * 5000


def test_a_retry_of_an_expired_or_failed_deferral_is_stored_afresh(tmp_path):
    # The same receipt id (an app's idempotency key) named the dead row: nothing queued.
    store = DeferredStore(tmp_path / "d.db")
    store.put("m", b"one", request_id="k", created_wall=1.0, expires_wall=5.0)
    assert store.expire(10.0) == ["k"]
    store.put("m", b"two", request_id="k", created_wall=11.0, expires_wall=50.0)
    assert store.result("k").status == "pending"
    assert [i.payload for i in store.pending(now_wall=12.0)] == [b"two"]
    store.mark_sending("k")
    store.mark_delivered("k", b"answer", None)
    store.put("m", b"three", request_id="k", created_wall=13.0, expires_wall=50.0)
    assert store.result("k").result == b"answer"  # answered: the retry is that one
    assert store.counts() == {"delivered": 1}


async def test_a_corrupt_row_fails_alone_and_the_rest_still_flush(tmp_path):
    import numpy as np

    from edge.deferred import Deferrer
    from shared import envelope
    from shared.messages import InferRequest, InferResponse
    from shared.tensors import Tensor

    store = DeferredStore(tmp_path / "d.db")
    store.put("m", b"\xc1 not msgpack", request_id="bad", created_wall=1.0, expires_wall=None)
    good = InferRequest(inputs=[Tensor.from_array("x", np.ones(2, np.float32))], id="good")
    store.put("m", envelope.encode_request(good), request_id="good", created_wall=2.0,
              expires_wall=None)  # fmt: skip
    deferrer = Deferrer(store)
    sent = []

    async def send(model, request):
        sent.append(request.id)
        return InferResponse(model_name=model, outputs=list(request.inputs), id=request.id)

    assert await deferrer.flush(send, lambda: True) == 2
    assert sent == ["good"]
    assert store.result("bad").status == "failed" and "unreadable" in store.result("bad").error
    assert store.result("good").status == "delivered"
    await deferrer.close()


def _fill_up(store: DeferredStore) -> None:
    """Cap the database at its current size: sqlite then fails writes with SQLITE_FULL,
    as on a full disk."""
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")


def test_a_full_disk_refuses_a_deferral_with_a_typed_error(tmp_path):
    import pytest

    from shared.errors import Overloaded

    store = DeferredStore(tmp_path / "d.db")
    store.put("m", b"x", request_id="a", created_wall=1.0, expires_wall=None)
    _fill_up(store)
    with pytest.raises(Overloaded, match="cannot take the request"):
        store.put("m", b"y" * 200_000, request_id="b", created_wall=1.0, expires_wall=None)


async def test_an_answer_the_full_store_cannot_write_is_kept_and_written_later(tmp_path):
    import time

    import numpy as np

    from edge.deferred import Deferrer
    from shared import envelope
    from shared.messages import InferRequest, InferResponse
    from shared.tensors import Tensor

    store = DeferredStore(tmp_path / "d.db")
    request = InferRequest(inputs=[Tensor.from_array("x", np.ones(4, np.float32))], id="r1")
    store.put("m", envelope.encode_request(request), request_id="r1", created_wall=time.time(),
              expires_wall=None)  # fmt: skip
    _fill_up(store)
    deferrer = Deferrer(store)
    big = np.ones(100_000, np.float32)  # an answer bigger than the room left

    async def send(model, request):
        return InferResponse(model_name=model, outputs=[Tensor.from_array("y", big)], id=request.id)

    assert await deferrer.flush(send, lambda: True) == 1
    found = await deferrer.result("r1")
    assert found["status"] == "delivered" and found["response"].outputs[0].data.shape == (100_000,)
    assert await deferrer.counts() == {"delivered": 1}  # not the "sending" its row still says
    assert await deferrer.flush(send, lambda: True) == 0  # still full: nothing resent
    store._db.execute("PRAGMA max_page_count = 1000000")  # room again
    await deferrer.flush(send, lambda: True)
    assert store.result("r1").status == "delivered" and not deferrer._unsaved
    assert await deferrer.counts() == {"delivered": 1}
    await deferrer.close()
