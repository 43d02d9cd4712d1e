"""One big request must not freeze a node: probes on other connections keep answering.

The bodies are BYTES tensors of millions of short elements of mixed lengths,
the costliest thing per byte a client can send (each element is parsed on
its own).  The bound checked here (a probe waits well under a second) is far
above the 50 ms target that ``bench/stalls.py`` measures; before the decode
moved off the loop these probes waited seconds.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import numpy as np
import pytest

from shared import envelope, v2
from shared.messages import InferRequest, InferResponse
from shared.tensors import Tensor
from tests.cloud.conftest import http_call
from tests.support import (
    cloud_server,
    mqtt_request,
    unbatched_identity_config,
    write_identity_model,
)


@pytest.fixture(scope="module")
def big_repository(tmp_path_factory: pytest.TempPathFactory):
    from onnx import TensorProto

    root = tmp_path_factory.mktemp("big")
    write_identity_model(root / "big_bytes" / "1" / "model.onnx", TensorProto.STRING)
    (root / "big_bytes" / "config.toml").write_text(unbatched_identity_config("BYTES"))
    return root


@pytest.fixture(scope="module")
def server(big_repository):
    proc = cloud_server(big_repository, "--node", "stall").start()
    yield proc
    proc.terminate()

#: the most BYTES elements a tensor may hold (Limits.max_bytes_elements), of mixed lengths
ELEMENTS = 65_535
MAX_PROBE_WAIT_S = 0.5


def _mixed_bytes(n: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    lengths = rng.integers(0, 3, size=n)
    pool = [b"", b"a", b"ab"]
    out = np.empty(n, dtype=object)
    out[:] = [pool[k] for k in lengths.tolist()]
    return out.reshape(-1, 3)


class _Prober:
    """Asks ``url`` again and again on its own connection; records the longest wait."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.longest = 0.0
        self.answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            with urllib.request.urlopen(self.url, timeout=30) as r:
                r.read()
            self.longest = max(self.longest, time.monotonic() - start)
            self.answered += 1
            time.sleep(0.005)

    def __enter__(self) -> _Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def test_a_big_bytes_body_is_decoded_off_the_loop_and_probes_keep_answering(server):
    data = _mixed_bytes(ELEMENTS)
    request = InferRequest(inputs=[Tensor("x", "BYTES", data)])
    chunks, header_length = v2.encode_request(request)
    body = v2.join(chunks)
    assert v2.decode_needs_worker(body, header_length)
    with _Prober(server.http_url + "/v2/health/live") as prober:
        status, headers, answer = http_call(
            server.http_url + "/v2/models/big_bytes/infer",
            body,
            {v2.HEADER_LENGTH: str(header_length), "Content-Type": "application/octet-stream"},
            timeout=120,
        )
    assert status == 200, answer[:300]
    length = headers.get(v2.HEADER_LENGTH) or headers.get(v2.HEADER_LENGTH.lower())
    response = v2.decode_response(answer, int(length) if length else None)
    assert response.outputs[0].data.reshape(-1).tolist() == data.reshape(-1).tolist()
    assert prober.answered > 0
    assert prober.longest < MAX_PROBE_WAIT_S, f"a probe waited {prober.longest:.2f} s"


def test_a_bytes_tensor_past_its_element_bound_is_refused_without_parsing_it(server):
    data = _mixed_bytes(3_000_000)
    chunks, header_length = v2.encode_request(
        InferRequest(inputs=[Tensor("x", "BYTES", data)])
    )
    with _Prober(server.http_url + "/v2/health/live") as prober:
        status, _, answer = http_call(
            server.http_url + "/v2/models/big_bytes/infer",
            v2.join(chunks),
            {v2.HEADER_LENGTH: str(header_length)},
        )
    assert status == 413 and b"max_bytes_elements" in answer, answer[:300]
    assert prober.longest < MAX_PROBE_WAIT_S, f"a probe waited {prober.longest:.2f} s"


def test_an_unknown_model_is_refused_before_its_body_is_decoded(server):
    body = b"\0" * (8 << 20)
    status, _, answer = http_call(
        server.http_url + "/v2/models/no_such_model/infer",
        body,
        {v2.HEADER_LENGTH: "1"},
    )
    assert status == 404, answer[:200]


@pytest.fixture
def mqtt_node(broker, big_repository):
    proc = cloud_server(big_repository, "--node", "stall-mqtt", "--mqtt", broker.url).start()
    yield proc
    proc.terminate()


def test_a_big_bytes_payload_over_mqtt_leaves_the_http_front_responsive(broker, mqtt_node):
    data = _mixed_bytes(ELEMENTS)
    payload = envelope.encode_request(
        InferRequest(inputs=[Tensor("x", "BYTES", data)], id="big")
    )
    assert envelope.decode_needs_worker(payload)
    with _Prober(mqtt_node.http_url + "/v2/health/live") as prober:
        raw = mqtt_request(broker.url, "big_bytes", payload, timeout=120)
    _, reply = envelope.decode_reply(raw)
    assert isinstance(reply, InferResponse), reply
    assert reply.outputs[0].data.reshape(-1).tolist() == data.reshape(-1).tolist()
    assert prober.answered > 0
    assert prober.longest < MAX_PROBE_WAIT_S, f"a probe waited {prober.longest:.2f} s"
