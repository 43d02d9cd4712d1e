"""What a node lets in: the byte budget over HTTP and MQTT, the connection cap, and
reaping of connections that stall mid-header or sit idle, on a real node over real
sockets (the server's own rules: tests/shared/http/test_server.py)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import numpy as np
import pytest

from shared import envelope
from shared.admission import ByteBudget
from shared.messages import InferRequest, InferResponse
from shared.tensors import Tensor
from tests.cloud.conftest import http_call, infer_body
from tests.support import cloud_server, mqtt_request


# ---- the budget, without sockets ------------------------------------------------------
def test_the_byte_budget_admits_one_request_of_any_size_but_bounds_the_sum():
    budget = ByteBudget(100)
    assert budget.try_take(500)  # alone: bounded by the body limit, not the budget
    assert not budget.try_take(1)
    budget.give(500)
    assert budget.try_take(60) and budget.try_take(40) and not budget.try_take(1)
    assert budget.refused == 2
    budget.give(100)
    # a request charged as its body comes grows past the bound only while it is alone
    assert budget.try_take(64) and budget.try_take(400, held=64)
    budget.give(464)
    assert budget.try_take(64) and budget.try_take(10) and not budget.try_take(400, held=64)


# ---- a real node ------------------------------------------------------------------------
@pytest.fixture
def tight_node(tmp_path: Path, test_repository: Path, broker):
    config = tmp_path / "cloud.toml"
    config.write_text(
        f'repository = "{test_repository}"\n'
        "[http]\nheader_timeout_s = 0.5\nidle_timeout_s = 1.0\nbody_timeout_s = 2.0\n"
        "max_connections = 24\n"
        "[limits]\nmax_inflight_bytes = 4000000\n"
    )
    proc = cloud_server(
        test_repository,
        "--config", str(config),
        "--models", "linear,echo_bytes",
        "--mqtt", broker.url,
        "--node", "tight",
    ).start()  # fmt: skip
    yield proc
    proc.terminate()


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_stalled_and_idle_connections_are_reaped_and_the_cap_holds(tight_node):
    address = _address(tight_node.http_url)
    silent = [socket.create_connection(address) for _ in range(8)]
    half = []
    for _ in range(8):
        s = socket.create_connection(address)
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")  # never finished
        half.append(s)
    assert all(_closed_by_peer(s, 5.0) for s in half), "half-header connections stayed open"
    assert all(_closed_by_peer(s, 5.0) for s in silent), "silent connections stayed open"
    for s in silent + half:
        s.close()
    held = [socket.create_connection(address) for _ in range(24)]
    time.sleep(0.2)
    extra = socket.create_connection(address)
    extra.settimeout(5)
    assert extra.recv(4096).startswith(b"HTTP/1.1 503")
    for s in [*held, extra]:
        s.close()
    time.sleep(0.3)
    status, _, _ = http_call(tight_node.http_url + "/v2/health/live")
    assert status == 200


def _stalled_upload(address, declared: int, sent: int) -> socket.socket:
    sock = socket.create_connection(address)
    sock.sendall(
        b"POST /v2/models/linear/infer HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n{"
        % declared
        + b" " * (sent - 1)
    )
    return sock


def test_bodies_past_the_node_budget_are_refused_before_they_are_read(tight_node, broker):
    address = _address(tight_node.http_url)
    # a client that has sent 3 MB of a body and stalls holds 3 MB of the 4 MB budget
    slow = _stalled_upload(address, 3_500_000, 3_000_000)
    time.sleep(0.5)
    body, headers = infer_body(np.zeros((1, 4), np.float32))
    status, _, _ = http_call(tight_node.http_url + "/v2/models/linear/infer", body, headers)
    assert status == 200
    status, answer_headers, answer = http_call(
        tight_node.http_url + "/v2/models/linear/infer",
        b"{" + b" " * 1_999_999,
        {"Content-Type": "application/json"},
    )
    assert status == 503 and b"overloaded" in answer, answer[:200]
    assert "Retry-After" in answer_headers
    # the same budget holds over MQTT
    reply = _mqtt_request(broker, "echo_bytes", 1_500_000)
    assert not isinstance(reply, InferResponse) and reply.code.value == "overloaded"
    # the stalled body times out (504) and gives its bytes back
    slow.settimeout(5.0)
    assert slow.recv(4096).startswith(b"HTTP/1.1 504")
    slow.close()
    time.sleep(0.3)
    reply = _mqtt_request(broker, "echo_bytes", 1_500_000)
    assert isinstance(reply, InferResponse), reply


def test_uploads_that_declare_much_and_send_little_do_not_hold_the_budget(tight_node):
    """The budget counts bytes that came: a few clients declaring 3 MB each and going
    silent had held a node's whole budget until their bodies timed out."""
    address = _address(tight_node.http_url)
    stalled = [_stalled_upload(address, 3_000_000, 1) for _ in range(6)]  # 18 MB declared
    time.sleep(0.3)
    body = b'{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}'
    status, _, answer = http_call(
        tight_node.http_url + "/v2/models/linear/infer",
        body + b" " * 2_000_000,  # 2 MB of it in flight: room for it beside the stalled ones
        {"Content-Type": "application/json"},
    )
    assert status == 200, answer[:200]
    for s in stalled:
        s.close()


def test_a_body_past_the_whole_budget_is_still_served_alone(tight_node):
    body = b'{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}'
    status, _, answer = http_call(
        tight_node.http_url + "/v2/models/linear/infer",
        body + b" " * 4_100_000,  # past the 4 MB budget: nothing else in flight
        {"Content-Type": "application/json"},
    )
    assert status == 200, answer[:200]


def test_a_compressed_body_is_charged_for_what_it_inflates_to(tight_node):
    import gzip

    address = _address(tight_node.http_url)
    body = b'{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}'
    packed = gzip.compress(body + b" " * 2_000_000)  # ~2 KB on the wire, 2 MB inflated
    url = tight_node.http_url + "/v2/models/linear/infer"
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    status, _, answer = http_call(url, packed, headers)
    assert status == 200, answer[:200]
    slow = _stalled_upload(address, 3_500_000, 3_000_000)  # 3 of the 4 MB held
    time.sleep(0.5)
    status, _, answer = http_call(url, packed, headers)
    assert status == 503 and b"overloaded" in answer, answer[:200]
    slow.close()


def _mqtt_request(broker, model: str, nbytes: int):
    item = b"x" * (nbytes // 6)
    data = np.empty((2, 3), dtype=object)
    data[:] = [[item] * 3] * 2
    payload = envelope.encode_request(InferRequest(inputs=[Tensor("x", "BYTES", data)], id="b"))
    return envelope.decode_reply(mqtt_request(broker.url, model, payload, timeout=30))[1]
