"""A real server process holding real slow requests: readiness, backpressure, deadlines,
hot reload, idempotent retries and the SIGTERM order (cloud/server.py).

The ``slow`` model really computes for ~100+ ms per run (a MatMul chain) and
runs each request alone, so tests can hold requests queued and in flight in
another process without gating it.  Conditions are awaited by polling the
server's own metrics, never by sleeping a guessed time.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.cloud.conftest import (
    build_slow_repository,
    decode_infer,
    http_call,
    infer_body,
    scrape_value,
)
from tests.support import ServerProcess, cloud_server


def _x(i: int, rows: int = 1) -> np.ndarray:
    return np.full((rows, 4), i + 1, np.float32)


def _infer(url: str, i: int, parameters: dict | None = None) -> tuple[int, dict, bytes]:
    body, headers = infer_body(_x(i), parameters)
    return http_call(url + "/v2/models/slow/infer", body, headers, timeout=60)


def _metric(url: str, name: str, **labels: str) -> float:
    return scrape_value(http_call(url + "/metrics")[2].decode(), name, model="slow", **labels)


def _wait_pending(url: str, at_least: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _metric(url, "nv_inference_pending_request_count") < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"fewer than {at_least} requests ever queued")
        time.sleep(0.01)


def _stats(url: str) -> dict:
    return json.loads(http_call(url + "/v2/models/slow/stats")[2])["model_stats"][0]


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory) -> ServerProcess:
    """Node queue bound 3 (the slow model sets none); a broken model in the repository."""
    root = build_slow_repository(tmp_path_factory.mktemp("slowrepo"), broken=True)
    (root.parent / "cloud.toml").write_text(
        f'repository = "{root}"\n[http]\nport = 0\n[limits]\nmax_queue_size = 3\n'
    )
    proc = cloud_server(root, "--config", str(root.parent / "cloud.toml")).start()
    yield proc
    proc.terminate()


def test_ready_is_false_while_a_requested_model_failed_to_load(slow_server):
    url = slow_server.http_url
    status, _, body = http_call(url + "/v2/health/ready")
    assert status == 503 and json.loads(body) == {"ready": False}
    assert http_call(url + "/v2/health/live")[0] == 200
    assert http_call(url + "/v2/models/slow/ready")[0] == 200  # the good model serves
    index = json.loads(http_call(url + "/v2/repository/index", b"{}")[2])
    broken = next(e for e in index if e["name"] == "broken")
    assert broken["state"] != "READY" and "nope" in broken["reason"]


def test_memory_usage_is_reported_for_the_loaded_model(slow_server):
    usage = _stats(slow_server.http_url)["memory_usage"]
    assert len(usage) == 1 and usage[0]["type"] == "CPU"
    assert usage[0]["byte_size"] > 0


def test_requests_refused_before_the_batcher_count_as_failures(slow_server):
    url = slow_server.http_url
    before = _stats(url)["inference_stats"]["fail"]["count"]
    other = _metric(url, "nv_inference_request_failure", reason="OTHER")
    bad_shape = infer_body(np.ones((1, 5), np.float32))
    assert http_call(url + "/v2/models/slow/infer", *bad_shape)[0] == 400
    assert _infer(url, 0, {"priority": -1})[0] == 400
    assert _infer(url, 0, {"timeout": "soon"})[0] == 400
    assert _stats(url)["inference_stats"]["fail"]["count"] == before + 3
    assert _metric(url, "nv_inference_request_failure", reason="OTHER") == other + 3


def test_full_default_queue_answers_503_with_retry_after(slow_server):
    """The slow model sets no max_queue_size: the node's [limits] max_queue_size (3) applies."""
    url = slow_server.http_url
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda i: (i, _infer(url, i)), range(12)))
    refused = [(h, b) for _, (s, h, b) in answers if s == 503]
    served = [(i, s, h, b) for i, (s, h, b) in answers if s == 200]
    assert len(refused) + len(served) == 12
    assert refused, "12 requests at once never filled a queue of 3"
    for headers, body in refused:
        assert json.loads(body)["code"] == "overloaded"
        assert int(headers["Retry-After"]) >= 1
    for i, status, headers, body in served:
        np.testing.assert_allclose(decode_infer(status, headers, body).outputs[0].data, _x(i))


def test_request_whose_timeout_passes_in_the_queue_gets_504(slow_server):
    url = slow_server.http_url
    with ThreadPoolExecutor(3) as pool:
        ahead = [pool.submit(_infer, url, i) for i in range(3)]
        _wait_pending(url, 2)  # one running, two queued ahead of ours
        status, _, body = _infer(url, 9, {"timeout": 20_000})  # 20 ms, in microseconds
        assert [f.result()[0] for f in ahead] == [200, 200, 200]
    assert status == 504 and json.loads(body)["code"] == "deadline_exceeded"


def test_hot_reload_of_the_same_model_drops_no_request_in_flight(slow_server):
    url = slow_server.http_url
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_infer, url, i) for i in range(3)]
        _wait_pending(url, 1)
        status, _, body = http_call(url + "/v2/repository/models/slow/load", b"{}")
        assert status == 200, body
        results = [f.result() for f in futures]
    for i, (status, headers, body) in enumerate(results):
        np.testing.assert_allclose(decode_infer(status, headers, body).outputs[0].data, _x(i))
    np.testing.assert_allclose(decode_infer(*_infer(url, 7)).outputs[0].data, _x(7))


def test_retried_request_with_an_idempotency_key_runs_once(slow_server):
    url = slow_server.http_url
    before = _stats(url)["execution_count"]
    key = {"idempotency_key": "edge-7:req-42"}
    with ThreadPoolExecutor(5) as pool:
        fillers = [pool.submit(_infer, url, i) for i in range(3)]
        _wait_pending(url, 2)  # one running, two queued
        first = pool.submit(_infer, url, 5, key)
        # the keyed request waits behind what is left of the fillers once the runs
        # done and the queue add up to three (one more runs): read the runs first, so
        # a run that ends between the two reads only makes the sum smaller
        deadline = time.monotonic() + 30
        while True:
            runs = _stats(url)["execution_count"] - before
            if runs < 3 and runs + _metric(url, "nv_inference_pending_request_count") >= 3:
                break
            assert time.monotonic() < deadline, "the keyed request never queued"
            time.sleep(0.01)
        second = pool.submit(_infer, url, 5, key)  # ...when its retry arrives
        a, b = decode_infer(*first.result()), decode_infer(*second.result())
        assert [f.result()[0] for f in fillers] == [200, 200, 200]
    c = decode_infer(*_infer(url, 5, key))  # after completion: from the cache
    np.testing.assert_allclose(a.outputs[0].data, _x(5))
    np.testing.assert_array_equal(a.outputs[0].data, b.outputs[0].data)
    np.testing.assert_array_equal(a.outputs[0].data, c.outputs[0].data)
    assert "duplicate" not in a.parameters
    assert b.parameters["duplicate"] is True and c.parameters["duplicate"] is True
    assert _stats(url)["execution_count"] == before + 4  # three fillers and one keyed run
    assert _metric(url, "ferry_inference_request_duplicate") >= 2


def test_sigterm_answers_every_request_in_flight_and_refuses_new_ones(tmp_path):
    root = build_slow_repository(tmp_path / "repo")
    proc = cloud_server(root).start()
    url = proc.http_url
    port = int(url.rsplit(":", 1)[1])
    n = 6
    results: dict[int, tuple[int, dict, bytes]] = {}

    def client(i: int) -> None:
        results[i] = _infer(url, i)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    kept = http.client.HTTPConnection("127.0.0.1", port, timeout=30)  # idle keep-alive
    kept.request("GET", "/v2/health/live")
    assert kept.getresponse().read() and True
    _wait_pending(url, n - 2)  # most of them queued behind the running one
    proc.proc.send_signal(signal.SIGTERM)
    # The listener closes at once, while the queue still holds seconds of work.
    give_up = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except ConnectionRefusedError:
            break
        assert time.monotonic() < give_up, "the listening socket stayed open"
        time.sleep(0.005)
    still_running = sum(1 for t in threads if t.is_alive())
    with pytest.raises(urllib.error.URLError) as refused:
        _infer(url, 99)
    assert isinstance(refused.value.reason, ConnectionRefusedError)
    # A connection opened before SIGTERM gets 503 (and Connection: close), not a reset.
    body, headers = infer_body(_x(98))
    try:
        kept.request("POST", "/v2/models/slow/infer", body, headers)
        late = kept.getresponse().status
    except (OSError, http.client.HTTPException) as exc:
        late = type(exc).__name__
    for t in threads:
        t.join(60)
    code = proc.proc.wait(60)
    assert code == 0 and "ferry-cloud stopped" in proc.output()
    assert still_running > 0, "every request had finished before the listener closed"
    assert late == 503
    assert sorted(results) == list(range(n))
    for i, (status, headers, body) in results.items():
        np.testing.assert_allclose(decode_infer(status, headers, body).outputs[0].data, _x(i))


def test_the_shutdown_grace_bounds_the_whole_stop(tmp_path):
    """Seconds of queued work, a one-second grace: the node exits at the grace, and every
    client gets an answer or a closed connection (none hangs)."""
    root = build_slow_repository(tmp_path / "repo")
    config = tmp_path / "cloud.toml"
    config.write_text(f'repository = "{root}"\nshutdown_grace_s = 1.0\n')
    proc = cloud_server(root, "--config", str(config)).start()
    url = proc.http_url
    n = 30  # ~100 ms each, one at a time: ~3 s of work
    outcomes: dict[int, object] = {}

    def client(i: int) -> None:
        try:
            outcomes[i] = _infer(url, i)[0]
        except (OSError, http.client.HTTPException) as exc:
            outcomes[i] = type(exc).__name__

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    _wait_pending(url, n // 2)
    sent = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    code = proc.proc.wait(30)
    took = time.monotonic() - sent
    for t in threads:
        t.join(30)
    assert code == 0
    assert took < 2.5, f"stop took {took:.1f} s with a 1 s grace"
    assert len(outcomes) == n  # nobody left hanging
    assert any(o == 200 for o in outcomes.values())


def test_a_sighup_during_a_rescan_is_followed_by_another_rescan(tmp_path):
    """ "Copy the files, then kill -HUP", landing while a rescan ran, was dropped: the
    running rescan had looked before the files came, and they were never loaded."""
    import shutil

    from tests.support import write_linear_model

    root = build_slow_repository(tmp_path / "repo")
    proc = cloud_server(root, "--node", "hup").start()
    try:
        for name in ("slow2", "slow3"):  # seconds of loading for the first rescan
            shutil.copytree(root / "slow", root / name)
        proc.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)  # it has looked at the folders and is loading
        write_linear_model(root / "late" / "1" / "model.onnx")
        proc.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while http_call(proc.http_url + "/v2/models/late/ready")[0] != 200:
            assert time.monotonic() < deadline, "".join(proc.lines[-20:])
            time.sleep(0.1)
        said = "".join(proc.lines)
        assert "a rescan is under way; another follows it" in said
    finally:
        proc.terminate()


def test_a_taken_http_port_is_said_before_any_model_loads(test_repository) -> None:
    # (it had been found only after every model was loaded: seconds and memory spent)
    import socket
    import subprocess
    import sys

    from tests.support import ROOT

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "cloud.cli", "serve", "--repository", str(test_repository),
             "--http-port", str(port)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert re.search(rf"cannot listen on [\d.:]+:{port}: ", done.stderr), done.stderr
    assert "loaded " not in done.stderr
