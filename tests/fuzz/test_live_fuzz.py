"""Live fuzzing: mutated requests against a real cloud node (real models, real Mosquitto).

A few hundred mutated V2 bodies go to ``/v2/models/{m}/infer`` (JSON and
binary, with valid and invalid ``Inference-Header-Content-Length`` values):
none may get a 5xx, every 4xx must carry a JSON error with a ``code``, and
every 200 must decode.  A few hundred mutated MessagePack requests go over
MQTT (v5, response topic + correlation data): each must get exactly one
reply, a result or a typed error (``internal`` is what the front sends for
an exception nobody typed, so it counts as a failure).  Afterwards the node
must still answer a valid request.

The mutations are the structure-aware ones of :mod:`tests.fuzz.harnesses`,
driven by ``random.Random(FERRY_FUZZ_SEED)``: a failure names the case index,
and the same seed replays the same cases.  ``FERRY_LIVE_FUZZ_SECONDS`` and
``FERRY_LIVE_FUZZ_COUNT`` bound each test (the first bound reached wins).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgspec
import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from shared import envelope, v2
from shared.datatypes import numpy_dtype
from shared.errors import ErrorCode
from shared.messages import InferRequest
from shared.tensors import Tensor
from tests.cloud.conftest import build_test_repository
from tests.fuzz.harnesses import byte_mutate, mutate
from tests.support import ServerProcess, cloud_server

SEED = int(os.environ.get("FERRY_FUZZ_SEED", "20240611"))
SECONDS = float(os.environ.get("FERRY_LIVE_FUZZ_SECONDS", "15"))
COUNT = int(os.environ.get("FERRY_LIVE_FUZZ_COUNT", "400"))
#: model -> (input datatype, features): linear takes FP32 [N, 4], the echoes [N, 3]
MODELS = {
    "linear": ("FP32", 4),
    "echo_fp16": ("FP16", 3),
    "echo_bf16": ("BF16", 3),
    "echo_bytes": ("BYTES", 3),
    "echo_bool": ("BOOL", 3),
    "echo_int64": ("INT64", 3),
    "echo_uint8": ("UINT8", 3),
}
CODES = {code.value for code in ErrorCode} - {ErrorCode.INTERNAL.value}
#: header values that are not a valid Inference-Header-Content-Length (or barely are)
BAD_LENGTHS = ["", "0", "-1", "abc", "1.5", "0x10", " 7 ", "+3", str(2**64), "99999999"]


@pytest.fixture(scope="module")
def fuzz_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_test_repository(tmp_path_factory.mktemp("repo"))


@pytest.fixture
def node(broker, fuzz_repository: Path) -> Iterator[ServerProcess]:
    proc = cloud_server(
        fuzz_repository, "--node", "fuzz", "--mqtt", broker.url, "--models", ",".join(MODELS)
    ).start()
    yield proc
    proc.terminate()


def _tensor(datatype: str, features: int, rows: int = 2) -> Tensor:
    if datatype == "BYTES":
        data = np.empty((rows, features), dtype=object)
        data[:] = [[f"r{r}c{c}".encode() for c in range(features)] for r in range(rows)]
        return Tensor("x", "BYTES", data)
    if datatype == "BOOL":
        return Tensor("x", "BOOL", np.eye(rows, features, dtype=bool))
    values = np.arange(rows * features, dtype=np.float64).reshape(rows, features)
    return Tensor("x", datatype, values.astype(numpy_dtype(datatype)))


def _valid_request(model: str, request_id: str | None = None) -> InferRequest:
    return InferRequest(inputs=[_tensor(*MODELS[model])], id=request_id)


def _mutations(target: str, data: bytes, rng: random.Random) -> bytes:
    """1-3 structure-aware mutations (plain-Python bytes for the byte-level ones)."""
    for _ in range(rng.randint(1, 3)):
        data = mutate(target, data, rng, 4096, lambda d, n: byte_mutate(d, n, rng))
    return data


# ---- HTTP ------------------------------------------------------------------------------


def _http_cases(rng: random.Random, count: int) -> list[tuple[str, bytes, dict[str, str]]]:
    """(path, body, headers) of each mutated request."""
    bases = []
    for model in MODELS:
        request = _valid_request(model, "fz")
        for binary in (False, True):
            chunks, hl = v2.encode_request(request, binary_inputs=binary, binary_outputs=binary)
            bases.append((model, v2.join(chunks), hl))
    cases = []
    for _ in range(count):
        model, body, hl = rng.choice(bases)
        if hl is None:
            body = _mutations("v2_json", body, rng)
            length = None if rng.random() < 0.85 else rng.choice(BAD_LENGTHS)
        else:
            data = _mutations("v2_binary", struct.pack(">H", hl) + body, rng)
            (derived,) = struct.unpack(">H", data[:2]) if len(data) >= 2 else (0,)
            body = data[2:]
            length = str(derived) if rng.random() < 0.75 else rng.choice(BAD_LENGTHS)
        headers = {"Content-Type": rng.choice([v2.JSON_CONTENT_TYPE, v2.BINARY_CONTENT_TYPE])}
        if length is not None:
            headers[v2.HEADER_LENGTH] = length
        roll = rng.random()
        if roll < 0.05:
            path = "/v2/models/nope/infer"
        elif roll < 0.1:
            path = f"/v2/models/{model}/versions/{rng.choice(['1', '2', '99', 'x', '-1'])}/infer"
        else:
            path = f"/v2/models/{model}/infer"
        cases.append((path, body, headers))
    return cases


async def test_mutated_http_bodies_get_a_typed_4xx_or_a_result(node: ServerProcess) -> None:
    cases = _http_cases(random.Random(SEED), COUNT)
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    stop_at = time.monotonic() + SECONDS
    gate = asyncio.Semaphore(4)

    async def send(session: aiohttp.ClientSession, i: int) -> None:
        path, body, headers = cases[i]
        async with gate:
            if time.monotonic() > stop_at:
                return
            async with session.post(node.http_url + path, data=body, headers=headers) as r:
                status, answer = r.status, await r.read()
                length = r.headers.get(v2.HEADER_LENGTH)
        statuses[status] += 1
        problem = None
        if status >= 500:
            problem = "a 5xx"
        elif status >= 400:
            try:
                doc = json.loads(answer)
                if not isinstance(doc, dict) or doc.get("code") not in CODES:
                    problem = "a 4xx without a typed code"
            except ValueError:
                problem = "a 4xx whose body is not JSON"
        elif status == 200:
            try:
                v2.decode_response(answer, int(length) if length else None)
            except Exception as exc:
                problem = f"a 200 that does not decode ({exc!r})"
        else:
            problem = f"status {status}"
        if problem:
            failures.append(
                f"case {i}: {problem}: {status} {answer[:300]!r}\n"
                f"  POST {path} {headers}\n  body {body[:600]!r}"
            )

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(send(session, i) for i in range(len(cases))))
        # the node still serves a valid request
        chunks, hl = v2.encode_request(_valid_request("linear"))
        async with session.post(
            node.http_url + "/v2/models/linear/infer",
            data=v2.join(chunks),
            headers={v2.HEADER_LENGTH: str(hl)},
        ) as r:
            assert r.status == 200, await r.text()
            answer = await r.read()
            result = v2.decode_response(answer, int(r.headers[v2.HEADER_LENGTH]))
    sent = sum(statuses.values())
    print(f"HTTP: {sent} mutated requests, statuses {dict(sorted(statuses.items()))}")
    assert result.outputs[0].shape == (2, 3)
    assert node.proc is not None and node.proc.poll() is None, "the node died"
    assert sent >= min(COUNT, 100), f"only {sent} requests went out in {SECONDS} s"
    assert not failures, f"{len(failures)} of {sent} failed:\n" + "\n".join(failures[:15])
    assert "Traceback" not in node.output(), node.output()[-4000:]


# ---- MQTT ------------------------------------------------------------------------------


class ReplyCollector:
    """A bare paho v5 client: publishes with a response topic and correlation data and
    keeps every reply payload it gets, per correlation (duplicates included)."""

    def __init__(self, port: int) -> None:
        self.topic = f"ferry/v1/replies/fuzz-{os.getpid()}"
        self.replies: dict[bytes, list[bytes]] = {}
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        c = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=f"fuzz-{os.getpid()}",
            protocol=mqtt.MQTTv5,
        )
        c.on_connect = lambda client, *_: client.subscribe(self.topic, qos=1)
        c.on_subscribe = lambda *_: self._subscribed.set()
        c.on_message = self._on_message
        c.connect("127.0.0.1", port)
        c.loop_start()
        self.client = c
        assert self._subscribed.wait(10), "never subscribed"

    def _on_message(self, client, userdata, message) -> None:
        correlation = bytes(getattr(message.properties, "CorrelationData", b"") or b"")
        with self._lock:
            self.replies.setdefault(correlation, []).append(bytes(message.payload))

    def publish(self, model: str, payload: bytes, correlation: bytes) -> None:
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = self.topic
        props.CorrelationData = correlation
        props.MessageExpiryInterval = 60
        self.client.publish(f"ferry/v1/models/{model}/infer", payload, qos=1, properties=props)

    def wait(self, correlations: list[bytes], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(c in self.replies for c in correlations):
                    return
            time.sleep(0.05)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _check_reply(payload: bytes) -> str | None:
    """None when ``payload`` is a result or a typed error; else what is wrong with it."""
    try:
        doc = msgspec.msgpack.decode(payload)
        envelope.decode_reply(payload)
    except Exception as exc:
        return f"an undecodable reply ({exc!r})"
    if not isinstance(doc, dict):
        return "a reply that is not a map"
    if "error" in doc:
        code = doc["error"].get("code") if isinstance(doc["error"], dict) else None
        return None if code in CODES else f"error code {code!r}"
    return None if isinstance(doc.get("outputs"), list) else "neither outputs nor an error"


def test_mutated_mqtt_requests_get_exactly_one_typed_reply(broker, node: ServerProcess) -> None:
    rng = random.Random(SEED + 1)
    bases = [
        (model, envelope.encode_request(_valid_request(model, f"req-{model}"))) for model in MODELS
    ]
    client = ReplyCollector(broker.port)
    try:
        # the node's subscriptions are in place once a valid request is answered
        for attempt in range(50):
            client.publish("linear", bases[0][1], b"warm-%d" % attempt)
            client.wait([b"warm-%d" % attempt], 0.2)
            if client.replies:
                break
        assert client.replies, "the node never answered over MQTT"
        sent: list[tuple[bytes, str, bytes]] = []
        stop_at = time.monotonic() + SECONDS
        for i in range(COUNT):
            if time.monotonic() > stop_at:
                break
            model, base = rng.choice(bases)
            payload = _mutations("envelope", base, rng)
            correlation = b"case-%d" % i
            client.publish(model, payload, correlation)
            sent.append((correlation, model, payload))
            time.sleep(0.005)  # a steady stream, not one burst
        client.wait([c for c, _, _ in sent], 60)
        time.sleep(1.0)  # a second reply, if any, arrives too
        client.publish("linear", bases[0][1], b"final")
        client.wait([b"final"], 20)
        replies = dict(client.replies)
    finally:
        client.close()
    failures = []
    kinds: Counter[str] = Counter()
    for i, (correlation, model, payload) in enumerate(sent):
        got = replies.get(correlation, [])
        problem = None if len(got) == 1 else f"{len(got)} replies"
        problem = problem or _check_reply(got[0])
        if not problem:
            doc = msgspec.msgpack.decode(got[0])
            kinds[doc["error"]["code"] if "error" in doc else "result"] += 1
        else:
            failures.append(
                f"case {i} ({model}): {problem}: {[r[:300] for r in got]!r}\n"
                f"  payload {payload[:600]!r}"
            )
    print(f"MQTT: {len(sent)} mutated requests, replies {dict(sorted(kinds.items()))}")
    final = replies.get(b"final")
    assert final and len(final) == 1, "the node stopped answering over MQTT"
    _, result = envelope.decode_reply(final[0])
    assert not isinstance(result, Exception), result
    assert result.outputs[0].shape == (2, 3)
    assert len(sent) >= min(COUNT, 100), f"only {len(sent)} requests went out in {SECONDS} s"
    assert not failures, f"{len(failures)} of {len(sent)} failed:\n" + "\n".join(failures[:15])
    assert "Traceback" not in node.output(), node.output()[-4000:]
