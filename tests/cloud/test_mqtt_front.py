"""The MQTT front through a real Mosquitto (project config, free port)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from edge.transports.http import HttpTransport
from edge.transports.mqtt import MqttTransport
from shared.errors import InvalidInput, ModelNotFound
from shared.messages import InferRequest
from shared.mqtt import parse_broker_url
from shared.tensors import Tensor
from tests.support import cloud_server


@pytest.fixture
def mqtt_server(broker, test_repository):
    proc = cloud_server(
        test_repository, "--node", "n1", "--mqtt", broker.url, "--models", "linear,auto"
    ).start()
    yield proc
    proc.terminate()


def _request(x: np.ndarray) -> InferRequest:
    return InferRequest(inputs=[Tensor.from_array("x", x)])


async def _client(broker) -> MqttTransport:
    t = MqttTransport(parse_broker_url(broker.url))
    await t.start()
    assert t.connected
    return t


async def test_mqtt_results_equal_the_http_path(broker, mqtt_server):
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    mq = await _client(broker)
    http = HttpTransport(mqtt_server.http_url)
    await http.start()
    try:
        a = await mq.infer("linear", _request(x), time.monotonic() + 10)
        b = await http.infer("linear", _request(x), time.monotonic() + 10)
    finally:
        await mq.close()
        await http.close()
    np.testing.assert_array_equal(a.response.outputs[0].data, b.response.outputs[0].data)
    assert a.response.model_version == "2" and a.response.parameters["node"] == "n1"
    assert {"queue_us", "compute_us"} <= set(a.response.parameters)
    assert a.sent_bytes > 0 and a.received_bytes > 0


async def test_mqtt_errors_come_back_typed(broker, mqtt_server):
    mq = await _client(broker)
    try:
        with pytest.raises(InvalidInput, match="no input 'z'"):
            await mq.infer(
                "linear",
                InferRequest(inputs=[Tensor.from_array("z", np.ones((1, 4), np.float32))]),
                time.monotonic() + 10,
            )
        # A model this node does not host: nobody subscribes, so the deadline answers.
        with pytest.raises(Exception) as info:
            await mq.infer(
                "echo_fp32", _request(np.ones((1, 3), np.float32)), time.monotonic() + 1.5
            )
        assert type(info.value).__name__ in ("DeadlineExceeded", "ModelNotFound")
    finally:
        await mq.close()


async def test_node_status_is_retained_with_hosted_models(broker, mqtt_server):
    got: list[dict] = []
    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5
    )
    client.on_message = lambda c, u, m: got.append(json.loads(m.payload))
    client.connect("127.0.0.1", broker.port)
    client.subscribe("ferry/v1/nodes/+/status", qos=1)
    client.loop_start()
    try:
        for _ in range(50):
            if got:
                break
            await asyncio.sleep(0.1)
    finally:
        client.loop_stop()
        client.disconnect()
    assert got and got[0]["node"] == "n1" and got[0]["state"] == "online"
    assert {m["name"] for m in got[0]["models"]} == {"linear", "auto"}


async def test_two_servers_share_one_subscription(broker, test_repository):
    a = cloud_server(
        test_repository, "--node", "A", "--mqtt", broker.url, "--models", "linear", "--no-http"
    ).start()
    b = cloud_server(
        test_repository, "--node", "B", "--mqtt", broker.url, "--models", "linear", "--no-http"
    ).start()
    mq = await _client(broker)
    try:
        x = np.ones((1, 4), np.float32)
        results = await asyncio.gather(
            *[mq.infer("linear", _request(x), time.monotonic() + 20) for _ in range(40)]
        )
    finally:
        await mq.close()
        a.terminate()
        b.terminate()
    nodes = [r.response.parameters["node"] for r in results]
    assert len(nodes) == 40
    assert set(nodes) == {"A", "B"}


async def test_broker_restart_mid_run_every_request_gets_one_answer(broker, mqtt_server):
    """A stream of requests across a broker restart: one answer each, then recovery."""
    mq = await _client(broker)
    answers: dict[str, tuple[float, object]] = {}
    sent: list[str] = []

    async def one(i: int) -> None:
        rid = f"r{i}-{uuid.uuid4().hex[:6]}"
        sent.append(rid)
        req = InferRequest(inputs=[Tensor.from_array("x", np.full((1, 4), i, np.float32))], id=rid)
        t = time.monotonic()
        try:
            result = (await mq.infer("linear", req, time.monotonic() + 20)).response
        except Exception as exc:
            result = exc
        assert rid not in answers, "two answers for one request"
        answers[rid] = (t, result)

    tasks: list[asyncio.Task[None]] = []
    try:
        restart_at = time.monotonic() + 1.0
        restarted = None
        i = 0
        while time.monotonic() < restart_at + 6.0:
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            if restarted is None and time.monotonic() >= restart_at:
                restarted = asyncio.create_task(asyncio.to_thread(broker.restart, 0.5))
            await asyncio.sleep(0.03)
        await restarted
        await asyncio.gather(*tasks)
    finally:
        await mq.close()
    assert len(answers) == len(sent) == i
    before = [r for t, r in answers.values() if t < restart_at]
    after = sorted((t, r) for t, r in answers.values() if t > restart_at + 4.0)
    assert before and all(not isinstance(r, Exception) for r in before)
    # Both the node and the client reconnected by themselves: work flows again.
    assert after and all(not isinstance(r, Exception) for _, r in after[-10:])


async def test_unknown_model_over_http_and_mqtt_share_the_error_code(broker, mqtt_server):
    http = HttpTransport(mqtt_server.http_url)
    await http.start()
    try:
        with pytest.raises(ModelNotFound):
            await http.infer("nope", _request(np.ones((1, 4), np.float32)), time.monotonic() + 5)
    finally:
        await http.close()
