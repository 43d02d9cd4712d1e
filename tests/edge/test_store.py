import os
import signal
import subprocess
import sys
import textwrap

import pytest

from edge.store import DeferredStore
from shared.errors import Overloaded


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
        # (twice the bounds on requests waiting: see the next test but one)
        assert held[0] <= 6 and held[1] <= 200 and (store._held_rows, store._held_bytes) == held
    kept = [i for i in range(8) if store.result(f"r{i}") is not None]
    assert 7 in kept and 0 not in kept and kept == sorted(kept)[-len(kept) :]
    assert store.result("r7").result == b"a" * 30


def test_the_answer_just_written_is_kept_and_the_first_answered_goes_first(tmp_path):
    # Trimming by when a request was deferred deleted the answer it had just stored
    # (deferred an hour ago, answered last): the app found no such request.
    store = DeferredStore(tmp_path / "d.db", max_rows=1, max_bytes=1000)
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
    from shared.messages import InferRequest
    from shared.tensors import Tensor

    store = DeferredStore(tmp_path / "d.db")
    store.put("m", b"\xc1 not msgpack", request_id="bad", created_wall=1.0, expires_wall=None)
    good = InferRequest(inputs=[Tensor.from_array("x", np.ones(2, np.float32))], id="good")
    store.put("m", envelope.encode_request(good), request_id="good", created_wall=2.0,
              expires_wall=None)  # fmt: skip
    deferrer = Deferrer(store)
    send, sent = _echo()
    assert await deferrer.flush(send, lambda model: True) == 2
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

    assert await deferrer.flush(send, lambda model: True) == 1
    found = await deferrer.result("r1")
    assert found["status"] == "delivered" and found["response"].outputs[0].data.shape == (100_000,)
    assert await deferrer.counts() == {"delivered": 1}  # not the "sending" its row still says
    assert await deferrer.flush(send, lambda model: True) == 0  # still full: nothing resent
    store._db.execute("PRAGMA max_page_count = 1000000")  # room again
    await deferrer.flush(send, lambda model: True)
    assert store.result("r1").status == "delivered" and not deferrer._unsaved
    assert await deferrer.counts() == {"delivered": 1}
    await deferrer.close()


async def test_a_failing_store_is_logged_once_with_its_path_and_its_recovery_once(tmp_path, caplog):
    # A full disk logged "deferred flush stopped" at every flush (one a second), naming
    # no file, and nothing at all when deferrals were refused or when it worked again.
    import logging
    import time

    import numpy as np
    import pytest

    from edge.deferred import Deferrer
    from edge.store import StoreFailed
    from shared.messages import InferRequest, InferResponse
    from shared.tensors import Tensor

    caplog.set_level(logging.INFO, "edge.deferred")
    store = DeferredStore(tmp_path / "d.db")
    store.put("m", _request_bytes("r1"), request_id="r1", created_wall=time.time(),
              expires_wall=None)  # fmt: skip
    _fill_up(store)
    deferrer = Deferrer(store)
    big = np.ones(100_000, np.float32)

    async def send(model, request):
        return InferResponse(model_name=model, outputs=[Tensor.from_array("y", big)], id=request.id)

    for _ in range(5):
        await deferrer.flush(send, lambda model: True)
    huge = InferRequest(inputs=[Tensor.from_array("x", big)], id="r2")
    for _ in range(3):
        with pytest.raises(StoreFailed):
            await deferrer.defer("m", huge, deadline_ms=None, reason="no link")
    said = [r for r in caplog.records if str(tmp_path / "d.db") in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.ERROR], said
    store._db.execute("PRAGMA max_page_count = 1000000")  # room again
    await deferrer.flush(send, lambda model: True)
    await deferrer.flush(send, lambda model: True)
    back = [r for r in caplog.records if "works again" in r.getMessage()]
    assert len(back) == 1 and str(tmp_path / "d.db") in back[0].getMessage()
    await deferrer.close()


def _request_bytes(request_id: str) -> bytes:
    import numpy as np

    from shared import envelope
    from shared.messages import InferRequest
    from shared.tensors import Tensor

    request = InferRequest(inputs=[Tensor.from_array("x", np.ones(2, np.float32))], id=request_id)
    return envelope.encode_request(request)


async def test_requests_expire_while_no_link_is_up_and_free_the_store(tmp_path):
    # Expiry ran only inside a flush with a link: an outage kept 20 dead requests
    # "pending" past their ttl, and the full store refused every new deferral.
    import time

    from edge.deferred import Deferrer

    store = DeferredStore(tmp_path / "d.db", max_rows=3)
    now = time.time()
    for i in range(3):
        store.put("m", _request_bytes(f"r{i}"), request_id=f"r{i}", created_wall=now - 10,
                  expires_wall=now - 1)  # fmt: skip
    deferrer = Deferrer(store)

    async def send(model, request):
        raise AssertionError("no link: nothing is sent")

    assert await deferrer.flush(send, lambda model: False) == 0
    assert [store.result(f"r{i}").status for i in range(3)] == ["expired"] * 3
    store.put("m", b"new", request_id="new", created_wall=now, expires_wall=now + 60)
    await deferrer.close()


def test_a_full_store_makes_room_by_expiring_the_dead_before_refusing(tmp_path):
    store = DeferredStore(tmp_path / "d.db", max_rows=2)
    store.put("m", b"a", request_id="a", created_wall=1.0, expires_wall=5.0)
    store.put("m", b"b", request_id="b", created_wall=1.0, expires_wall=50.0)
    store.put("m", b"c", request_id="c", created_wall=10.0, expires_wall=60.0)
    assert store.result("a").status == "expired" and store.result("c").status == "pending"


def test_a_whole_store_expiring_at_once_keeps_every_receipt(tmp_path):
    # Answers were kept up to the waiting bound: 18 kept + 20 expiring at once were cut
    # to 18, forgetting 2 receipts issued seconds before (a 404, like a bogus id).
    store = DeferredStore(tmp_path / "d.db", max_rows=20)
    for i in range(18):
        store.put("m", b"x", request_id=f"old{i}", created_wall=1.0, expires_wall=None)
        store.mark_delivered(f"old{i}", b"answer", None, now_wall=2.0 + i)
    for i in range(20):
        store.put("m", b"x", request_id=f"new{i}", created_wall=50.0, expires_wall=100.0)
    assert len(store.expire(200.0)) == 20
    assert all(store.result(f"new{i}").status == "expired" for i in range(20))
    held = store._db.execute("SELECT COUNT(*) FROM deferred").fetchone()[0]
    assert held <= 40  # still bounded: twice the waiting bound


def test_a_request_bigger_than_the_whole_store_is_too_large_not_retry_later(tmp_path):
    import pytest

    from shared.errors import PayloadTooLarge

    store = DeferredStore(tmp_path / "d.db", max_bytes=100)
    with pytest.raises(PayloadTooLarge, match="at most 100 bytes"):
        store.put("m", b"x" * 101, request_id="big", created_wall=1.0, expires_wall=None)


async def test_a_clean_stop_mid_send_puts_the_request_back_without_an_attempt(tmp_path):
    # A SIGTERM during a send left the row "sending": the next open counted a crash
    # attempt, and a few clean restarts used up max_attempts.
    import asyncio
    import time

    from edge.deferred import Deferrer

    path = tmp_path / "d.db"
    store = DeferredStore(path)
    store.put("m", _request_bytes("r"), request_id="r", created_wall=time.time(),
              expires_wall=None)  # fmt: skip
    deferrer = Deferrer(store)
    started = asyncio.Event()

    async def send(model, request):
        started.set()
        await asyncio.sleep(60)

    flush = asyncio.create_task(deferrer.flush(send, lambda model: True))
    await started.wait()
    assert store.counts() == {"sending": 1}
    flush.cancel()
    await asyncio.gather(flush, return_exceptions=True)
    await deferrer.close()
    reopened = DeferredStore(path)
    (item,) = reopened.pending()
    assert item.request_id == "r" and item.attempts == 0
    reopened.close()


async def test_a_model_no_transport_takes_now_waits_untouched_while_others_go(tmp_path):
    # With the broker up but no node serving the model, every tick marked each row
    # sending and back (two fsyncs) and logged a line per row for the whole outage.
    import time

    from edge.deferred import Deferrer

    store = DeferredStore(tmp_path / "d.db")
    for name, model in (("a", "unserved"), ("b", "served")):
        store.put(model, _request_bytes(name), request_id=name, created_wall=time.time(),
                  expires_wall=None)  # fmt: skip
    deferrer = Deferrer(store)
    send, sent = _echo()
    writes = []
    store._db.set_trace_callback(lambda sql: writes.append(sql) if "'a'" in sql else None)
    assert await deferrer.flush(send, lambda model: model != "unserved") == 1
    assert sent == ["b"] and store.result("a").status == "pending"
    assert not [w for w in writes if w.startswith("UPDATE")]
    await deferrer.close()


async def test_a_backlog_drains_in_one_tick_past_rows_of_a_model_nobody_takes(tmp_path):
    # 50 per tick, a full store took minutes to drain after the link came back; and
    # 50 rows of a model nobody served hid the rest behind them.
    import time

    from edge.deferred import Deferrer

    store = DeferredStore(tmp_path / "d.db")
    now = time.time()
    for i in range(60):
        store.put("unserved", _request_bytes(f"u{i}"), request_id=f"u{i}", created_wall=now - 100,
                  expires_wall=None)  # fmt: skip
    for i in range(200):
        store.put("served", _request_bytes(f"s{i}"), request_id=f"s{i}", created_wall=now,
                  expires_wall=None)  # fmt: skip
    deferrer = Deferrer(store)
    send, sent = _echo()
    assert await deferrer.flush(send, lambda model: model != "unserved") == 200
    assert len(sent) == 200 and store.counts() == {"pending": 60, "delivered": 200}
    await deferrer.close()


async def test_one_flush_tries_a_request_once_however_many_batches_it_sends(tmp_path):
    # A row put back came up again in the flush's next batch: a transient 500 used
    # every attempt within milliseconds, and "retry later" hammered an overloaded cloud.
    import time

    from edge.deferred import Deferrer
    from shared.errors import InternalError

    store = DeferredStore(tmp_path / "d.db")
    now = time.time()
    store.put("m", _request_bytes("bad"), request_id="bad", created_wall=now - 10,
              expires_wall=None)  # fmt: skip
    for i in range(120):
        store.put("m", _request_bytes(f"r{i}"), request_id=f"r{i}", created_wall=now,
                  expires_wall=None)  # fmt: skip
    deferrer = Deferrer(store, max_attempts=5)
    echo, _ = _echo()
    tries = []

    async def send(model, request):
        if request.id == "bad":
            tries.append(1)
            raise InternalError("the node broke on it")
        return await echo(model, request)

    assert await deferrer.flush(send, lambda model: True) == 120
    assert len(tries) == 1 and store.result("bad").status == "pending"
    await deferrer.close()


def _echo():
    """A sender answering each request with its inputs, and the ids it was sent."""
    from shared.messages import InferResponse

    sent: list[str] = []

    async def send(model, request):
        sent.append(request.id)
        return InferResponse(model_name=model, outputs=list(request.inputs), id=request.id)

    return send, sent


async def test_a_batch_with_no_answer_ends_the_flush_instead_of_trying_the_whole_backlog(
    tmp_path,
):
    # Without it, a node failing every request (a 500) took every row's attempt each tick
    # and a backlog of 1000 failed for good in five seconds.
    import time

    from edge.deferred import Deferrer
    from shared.errors import InternalError

    store = DeferredStore(tmp_path / "d.db")
    for i in range(300):
        store.put("m", _request_bytes(f"r{i}"), request_id=f"r{i}", created_wall=time.time(),
                  expires_wall=None)  # fmt: skip
    deferrer = Deferrer(store, max_attempts=5)
    tries = []

    async def send(model, request):
        tries.append(request.id)
        raise InternalError("the node fails them all")

    assert await deferrer.flush(send, lambda model: True) == 0
    assert len(tries) == 50  # one batch, then the flush stopped
    assert store.counts() == {"pending": 300}
    await deferrer.close()


def test_a_retry_of_a_stored_deferral_gets_its_receipt_though_the_store_is_full(tmp_path):
    """The bound was checked before the same id was looked up: a retry whose first try
    was stored got 503 overloaded, and no way to learn its receipt."""
    store = DeferredStore(tmp_path / "d.db", max_rows=2, max_bytes=10)
    store.put("m", b"aaaaa", request_id="a", created_wall=1.0, expires_wall=50.0)
    store.put("m", b"bbbbb", request_id="b", created_wall=1.0, expires_wall=50.0)
    store.put("m", b"aaaaa", request_id="a", created_wall=2.0, expires_wall=50.0)  # a retry
    with pytest.raises(Overloaded):
        store.put("m", b"c", request_id="c", created_wall=2.0, expires_wall=50.0)  # new: full
    store.mark_sending("b")
    store.put("m", b"bbbbb", request_id="b", created_wall=3.0, expires_wall=50.0)  # in flight
    assert store.result("a").status == "pending" and store.result("b").status == "sending"
    assert store.counts() == {"pending": 1, "sending": 1}


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_store_is_moved_aside_and_the_agent_starts_on_a_new_one(tmp_path, damage):
    db = tmp_path / "d.db"
    store = DeferredStore(db)
    for i in range(200):
        store.put("m", b"x" * 1000, request_id=f"r{i}", created_wall=1.0, expires_wall=None)
    store.close()
    data = db.read_bytes()
    db.write_bytes(os.urandom(len(data)) if damage == "garbage" else data[: len(data) // 2])
    fresh = DeferredStore(db)  # (a raw sqlite traceback at the agent's start, before)
    assert fresh.pending() == []
    fresh.put("m", b"y", request_id="new", created_wall=1.0, expires_wall=None)
    assert [i.request_id for i in fresh.pending()] == ["new"]
    assert len(list(tmp_path.glob("d.db.corrupt-*"))) == 1  # kept for inspection


def test_a_store_that_cannot_be_opened_is_a_config_error_naming_state_dir(tmp_path):
    from shared.errors import ConfigError

    db = tmp_path / "d.db"
    DeferredStore(db).put("m", b"x", request_id="a", created_wall=1.0, expires_wall=None)
    db.unlink()
    db.mkdir()  # (what sqlite meets in a folder it cannot open: as root, chmod is no bar)
    with pytest.raises(ConfigError, match="state_dir"):
        DeferredStore(db)


async def test_a_read_during_close_is_refused_and_does_not_reopen_the_store(tmp_path):
    # A /metrics scrape or a result poll queued behind close had reopened the store
    # (a leaked connection, and its "sending" rows counted as a crash's attempt).
    import asyncio

    from edge.deferred import Deferrer
    from shared.errors import ShuttingDown

    store = DeferredStore(tmp_path / "d.db")
    store.put("m", b"x", request_id="a", created_wall=1.0, expires_wall=None)
    deferrer = Deferrer(store)
    closing = asyncio.ensure_future(deferrer.close())
    await asyncio.sleep(0)  # close has begun
    with pytest.raises(ShuttingDown):
        await deferrer.result("a")
    await closing
    assert store._conn is None


async def test_a_model_whose_requests_are_refused_waits_longer_each_time(tmp_path):
    """A broker's ACL refusal was tried (and logged) every second for the whole ttl."""
    import time

    from edge import deferred
    from edge.deferred import Deferrer
    from shared.errors import PermissionDenied

    store = DeferredStore(tmp_path / "d.db")
    for name, model in (("a", "locked"), ("b", "open")):
        store.put(model, _request_bytes(name), request_id=name, created_wall=time.time(),
                  expires_wall=None)  # fmt: skip
    deferrer = Deferrer(store)
    echo, sent = _echo()
    refused = []

    async def send(model, request):
        if model == "locked":
            refused.append(request.id)
            raise PermissionDenied("not authorized by its ACL")
        return await echo(model, request)

    assert await deferrer.flush(send, lambda model: True) == 1
    assert refused == ["a"] and sent == ["b"]
    await deferrer.flush(send, lambda model: True)
    assert refused == ["a"]  # held back, not tried a second later
    _, wait = deferrer._refused["locked"]
    assert wait == deferred.REFUSED_FIRST_WAIT_S
    deferrer._refused["locked"] = (time.monotonic() - 1, wait)  # the wait is over
    await deferrer.flush(send, lambda model: True)
    assert refused == ["a", "a"] and deferrer._refused["locked"][1] == 2 * wait
    assert store.result("a").status == "pending"  # kept: the operator's to fix
    await deferrer.close()


async def test_a_clock_stepped_by_days_keeps_what_was_deferred_before_it(tmp_path):
    # A device without a real-time clock defers offline; NTP then steps its clock
    # forward by the days it was off: the backlog must be sent, not expired.
    import numpy as np

    from edge.deferred import Deferrer
    from shared import envelope
    from shared.messages import InferRequest
    from shared.tensors import Tensor
    from shared.wallclock import WallClock

    clock = {"wall": 1_000_000.0, "elapsed": 50.0}
    x = [Tensor.from_array("x", np.ones(2, np.float32))]
    store = DeferredStore(tmp_path / "d.db")
    old = envelope.encode_request(InferRequest(inputs=x, id="before-boot"))
    store.put("m", old, request_id="before-boot", created_wall=999_000.0, expires_wall=1e9)
    deferrer = Deferrer(store, ttl_s=3600.0)
    deferrer._clock = WallClock(lambda: clock["wall"], lambda: clock["elapsed"])
    for i in range(3):
        await deferrer.defer("m", InferRequest(inputs=x, id=f"r{i}"), deadline_ms=None, reason="")
    clock["wall"] += 2 * 86_400.0 + 1.0  # the step, and one second of real time
    clock["elapsed"] += 1.0
    send, sent = _echo()
    assert await deferrer.flush(send, lambda model: True) == 4
    assert sorted(sent) == ["before-boot", "r0", "r1", "r2"]
    # the rows stamped before the step moved with it; the one from before boot did not
    rows = dict(store._db.execute("SELECT request_id, created_wall FROM deferred").fetchall())
    assert rows["r0"] == pytest.approx(1_000_000.0 + 2 * 86_400.0)
    assert rows["before-boot"] == 999_000.0
    # a real wait past the ttl still expires (the step did not make the ttl longer)
    await deferrer.defer("m", InferRequest(inputs=x, id="late"), deadline_ms=None, reason="")
    clock["wall"] += 3601.0
    clock["elapsed"] += 3601.0
    assert await deferrer.flush(send, lambda model: False) == 0
    assert store.result("late").status == "expired"
    await deferrer.close()


async def test_a_clock_step_read_by_a_deferral_and_a_flush_at_once_moves_the_rows_once(tmp_path):
    import asyncio

    import numpy as np

    from edge.deferred import Deferrer
    from shared.messages import InferRequest
    from shared.tensors import Tensor
    from shared.wallclock import WallClock

    clock = {"wall": 1_000_000.0, "elapsed": 50.0}
    store = DeferredStore(tmp_path / "d.db")
    deferrer = Deferrer(store, ttl_s=3600.0)
    deferrer._clock = WallClock(lambda: clock["wall"], lambda: clock["elapsed"])
    x = [Tensor.from_array("x", np.ones(2, np.float32))]
    await deferrer.defer("m", InferRequest(inputs=x, id="before"), deadline_ms=None, reason="")
    clock["wall"] += 86_400.0
    send, _ = _echo()
    await asyncio.gather(
        deferrer.defer("m", InferRequest(inputs=x, id="a"), deadline_ms=None, reason=""),
        deferrer.defer("m", InferRequest(inputs=x, id="b"), deadline_ms=None, reason=""),
        deferrer.flush(send, lambda model: False),
    )
    rows = dict(store._db.execute("SELECT request_id, created_wall FROM deferred").fetchall())
    assert rows == {"before": 1_086_400.0, "a": 1_086_400.0, "b": 1_086_400.0}
    await deferrer.close()


@pytest.mark.parametrize("same_boot", [True, False])
async def test_an_agent_restarted_offline_keeps_the_backlog_through_a_later_clock_step(
    tmp_path, same_boot
):
    # A crash-looping agent offline on a clock-less device: the process that sees NTP's
    # step is not the one that stamped the rows; it had expired them all.
    import numpy as np

    from edge.deferred import Deferrer
    from shared.messages import InferRequest
    from shared.tensors import Tensor
    from shared.wallclock import WallClock

    x = [Tensor.from_array("x", np.ones(2, np.float32))]
    t = {"wall": 1_000_000.0, "elapsed": 50.0}

    def clock(boot: str) -> WallClock:
        return WallClock(lambda: t["wall"], lambda: t["elapsed"], boot=boot)

    first = Deferrer(DeferredStore(tmp_path / "d.db"), ttl_s=3600.0)
    first._clock = clock("boot-1")
    await first.defer("m", InferRequest(inputs=x, id="r1"), deadline_ms=None, reason="")
    await first.close()
    t["elapsed"] += 5.0  # restarted (no step yet): the second process defers one more
    t["wall"] += 5.0
    second = Deferrer(DeferredStore(tmp_path / "d.db"), ttl_s=3600.0)
    second._clock = clock("boot-1")
    await second.defer("m", InferRequest(inputs=x, id="r2"), deadline_ms=None, reason="")
    await second.close()
    t["wall"] += 2 * 86_400.0  # NTP steps it by the days the device was off; restart again
    t["elapsed"] += 1.0
    if not same_boot:  # (a reboot: a new boot time, whose offset says nothing of a step)
        t["elapsed"] = 3.0
    store = DeferredStore(tmp_path / "d.db")
    third = Deferrer(store, ttl_s=3600.0)
    third._clock = clock("boot-1" if same_boot else "boot-2")
    send, sent = _echo()
    await third.flush(send, lambda model: True)
    if same_boot:
        assert sorted(sent) == ["r1", "r2"]  # both processes' rows kept their ttl
    else:
        assert sent == [] and store.counts() == {"expired": 2}  # true time: a real wait
    await third.close()
