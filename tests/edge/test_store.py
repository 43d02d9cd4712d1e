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
