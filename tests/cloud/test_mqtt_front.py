"""The MQTT front through a real Mosquitto (project config, free port)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
import urllib.request
import uuid

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge.transports.http import HttpTransport
from edge.transports.mqtt import MqttTransport
from shared import envelope
from shared.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    Overloaded,
    ShuttingDown,
)
from shared.messages import InferRequest
from shared.mqtt import parse_broker_url
from shared.tensors import Tensor
from tests.cloud.conftest import build_slow_repository
from tests.support import SecuredBroker, cloud_server, write_linear_model


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
        # A model this node does not host: nobody subscribes, and the PUBACK says so.
        with pytest.raises(ModelNotReady):
            await mq.infer(
                "echo_fp32", _request(np.ones((1, 3), np.float32)), time.monotonic() + 10
            )
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


async def test_unknown_model_over_http_and_mqtt_share_the_error_code(broker, mqtt_server):
    http = HttpTransport(mqtt_server.http_url)
    await http.start()
    try:
        with pytest.raises(ModelNotFound):
            await http.infer("nope", _request(np.ones((1, 4), np.float32)), time.monotonic() + 5)
    finally:
        await http.close()


async def test_a_request_no_node_subscribes_to_fails_at_its_puback_not_its_deadline(
    broker, mqtt_server
):
    """The broker drops a request no subscription matches and says so in its PUBACK
    ("no matching subscribers"): the agent fails it then, as not ready, instead of
    waiting out a deadline for a reply that cannot come (and blaming the link)."""
    mq = await _client(broker)
    try:
        with pytest.raises(ModelNotReady, match="no cloud node takes requests for model 'nope'"):
            await mq.infer("nope", _request(np.ones((1, 4), np.float32)), time.monotonic() + 30)
        # a hosted model on the same connection is answered as before
        done = await mq.infer(
            "linear", _request(np.ones((1, 4), np.float32)), time.monotonic() + 10
        )
        assert done.response.parameters["node"] == "n1"
    finally:
        await mq.close()


# ---- a bare paho client: every reply it counts is one the node really sent ------------------
class RawClient:
    """Publishes requests with MQTT v5 properties and records each reply by correlation.

    Unlike the edge transport it never answers for the server: no client-side
    deadline errors, no "not connected" errors, no dropping of second replies.
    """

    def __init__(self, broker, *, client_id: str | None = None, **tls) -> None:
        self.client_id = client_id or f"raw-{uuid.uuid4().hex[:8]}"
        self.reply_topic = f"ferry/v1/replies/{self.client_id}"
        self.replies: dict[bytes, list[tuple[float, object]]] = {}
        self.statuses: list[tuple[float, dict]] = []
        self.subscribed_at: list[float] = []
        self._lock = threading.Lock()
        c = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=mqtt.MQTTv5,
        )
        if tls.get("username"):
            c.username_pw_set(tls["username"], tls.get("password"))
        if tls.get("ca_file"):
            c.tls_set(ca_certs=str(tls["ca_file"]))
        c.on_connect = self._on_connect
        c.on_subscribe = lambda *a: self.subscribed_at.append(time.monotonic())
        c.on_message = self._on_message
        c.reconnect_delay_set(min_delay=1, max_delay=2)
        c.connect("127.0.0.1", broker.port)
        c.loop_start()
        self.client = c
        self._wait(lambda: self.subscribed_at, 10, "never subscribed")

    def _on_connect(self, client, userdata, flags, reason, props) -> None:
        if not reason.is_failure:
            client.subscribe([(self.reply_topic, 1), ("ferry/v1/nodes/+/status", 1)])

    def _on_message(self, client, userdata, message) -> None:
        now = time.monotonic()
        if message.topic.startswith("ferry/v1/nodes/"):
            if not message.retain:  # published now, not a retained copy from before
                self.statuses.append((now, json.loads(message.payload)))
            return
        correlation = bytes(message.properties.CorrelationData)
        _, result = envelope.decode_reply(message.payload)
        with self._lock:
            self.replies.setdefault(correlation, []).append((now, result))

    def publish(
        self,
        model: str,
        x: np.ndarray,
        *,
        expiry: int = 30,
        parameters: dict | None = None,
        reply_topic: str | None = None,
    ) -> bytes:
        rid = uuid.uuid4().hex
        req = InferRequest(
            inputs=[Tensor.from_array("x", x)], id=rid, parameters=dict(parameters or {})
        )
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = reply_topic or self.reply_topic
        props.CorrelationData = rid.encode()
        props.MessageExpiryInterval = expiry
        self.client.publish(
            f"ferry/v1/models/{model}/infer", envelope.encode_request(req), qos=1, properties=props
        )
        return rid.encode()

    def _wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(what)
            time.sleep(0.02)

    def wait_replies(self, correlations: list[bytes], timeout: float = 60) -> None:
        self._wait(
            lambda: all(c in self.replies for c in correlations),
            timeout,
            f"{sum(c not in self.replies for c in correlations)} requests never got a reply",
        )

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _slow_node(broker, root, *extra: str, toml: str = ""):
    (root.parent / "cloud.toml").write_text(
        f'repository = "{root}"\n[http]\nport = 0\n[mqtt]\nurl = "{broker.url}"\n{toml}'
    )
    return cloud_server(root, "--config", str(root.parent / "cloud.toml"), *extra).start()


def test_message_expiry_becomes_a_deadline_error_reply(broker, tmp_path):
    """Requests that expire while queued behind slow work get the server's own deadline error."""
    node = _slow_node(broker, build_slow_repository(tmp_path / "repo"))
    raw = RawClient(broker)
    try:
        sent = [
            raw.publish("slow", np.full((1, 4), i + 1, np.float32), expiry=1) for i in range(60)
        ]
        raw.wait_replies(sent)
    finally:
        raw.close()
        node.terminate()
    kinds = []
    for i, c in enumerate(sent):
        (_, result), *more = raw.replies[c]
        assert not more, "two replies for one request"
        if isinstance(result, DeadlineExceeded):
            kinds.append("deadline")
        else:
            np.testing.assert_allclose(result.outputs[0].data, np.full((1, 4), i + 1))
            kinds.append("ok")
    # 60 runs of 40-100 ms (by the machine) cannot all fit in the 1 s expiry
    assert kinds[0] == "ok" and "deadline" in kinds


def test_a_wildcard_response_topic_is_not_published_to_and_the_node_stays_connected(
    broker, tmp_path
):
    """A PUBLISH to a wildcard is a protocol error: the broker would disconnect the node and
    every request it held would go unanswered.  The bad request is dropped, logged."""
    node = _slow_node(broker, build_slow_repository(tmp_path / "repo"))
    raw = RawClient(broker)
    try:
        x = np.ones((1, 4), np.float32)
        sent = [raw.publish("slow", x * (i + 1)) for i in range(6)]
        for bad in ("ferry/v1/replies/+/x", "ferry/v1/replies/#"):
            raw.publish("slow", x, reply_topic=bad)
        # outside the replies tree: a status (blanks a node in the fleet view), a
        # request topic (a loop), anything else
        for bad in ("ferry/v1/nodes/n1/status", "ferry/v1/models/slow/infer", "other/x"):
            raw.publish("slow", x, reply_topic=bad)
        sent += [raw.publish("slow", x * (i + 7)) for i in range(6)]
        raw.wait_replies(sent, timeout=30)
    finally:
        raw.close()
        node.terminate()
    for i, c in enumerate(sent):
        (_, result), *more = raw.replies[c]
        assert not more
        np.testing.assert_allclose(result.outputs[0].data, np.full((1, 4), i + 1))
    log = node.output()
    assert "wildcard" in log and "broker disconnected us" not in log
    assert log.count("outside ferry/v1/replies/#") == 3


def test_flood_beyond_the_in_flight_cap_gets_overloaded_replies_with_a_retry_hint(broker, tmp_path):
    node = _slow_node(
        broker, build_slow_repository(tmp_path / "repo"), toml="[limits]\nmax_inflight_mqtt = 2\n"
    )
    raw = RawClient(broker)
    try:
        sent = [raw.publish("slow", np.full((1, 4), i + 1, np.float32)) for i in range(10)]
        raw.wait_replies(sent)
    finally:
        raw.close()
        node.terminate()
    results = [raw.replies[c] for c in sent]
    assert all(len(r) == 1 for r in results)
    refused = [r[0][1] for r in results if isinstance(r[0][1], Overloaded)]
    served = [r[0][1] for r in results if not isinstance(r[0][1], Exception)]
    assert len(refused) + len(served) == 10
    assert refused and len(served) >= 2
    assert all(e.retry_after is not None and e.retry_after > 0 for e in refused)


def test_a_311_client_past_the_in_flight_cap_is_answered_overloaded_on_its_reply_topic(
    broker, tmp_path
):
    # Only a served request read the envelope's reply_topic: one refused on intake got
    # no answer at all, and its client waited out its own timeout.
    node = _slow_node(
        broker, build_slow_repository(tmp_path / "repo"), toml="[limits]\nmax_inflight_mqtt = 1\n"
    )
    old, answers = _mqtt311(broker, "dev311", "ferry/v1/replies/dev311")
    try:
        x = np.ones((1, 4), np.float32)
        for i in range(6):
            request = InferRequest(
                inputs=[Tensor.from_array("x", x)],
                id=f"r{i}",
                parameters={"reply_topic": "ferry/v1/replies/dev311"},
            )
            old.publish("ferry/v1/models/slow/infer", envelope.encode_request(request), qos=1)
        got = [envelope.decode_reply(answers.get(timeout=30).payload) for _ in range(6)]
    finally:
        _close311(old)
        node.terminate()
    assert sorted(request_id for request_id, _ in got) == [f"r{i}" for i in range(6)]
    assert any(isinstance(reply, Overloaded) for _, reply in got)


def test_a_reply_topic_with_a_control_character_is_not_served_and_the_node_stays_on(
    broker, tmp_path
):
    # One 3.1.1 request naming ".../\x01" had the broker cut the node off, again at
    # every reconnect while it resent the held answer: every other device unanswered.
    node = _slow_node(broker, build_slow_repository(tmp_path / "repo"))
    raw = RawClient(broker)
    old, answers = _mqtt311(broker, "dev311")
    try:
        x = np.ones((1, 4), np.float32)
        for i, bad in enumerate(("ferry/v1/replies/dev311/\x01", "ferry/v1/replies/dev311/\ufffe")):
            request = InferRequest(
                inputs=[Tensor.from_array("x", x)], id=f"bad{i}", parameters={"reply_topic": bad}
            )
            old.publish("ferry/v1/models/slow/infer", envelope.encode_request(request), qos=1)
        time.sleep(0.5)
        sent = [raw.publish("slow", x * (i + 1)) for i in range(4)]
        raw.wait_replies(sent, timeout=30)
    finally:
        _close311(old)
        raw.close()
        node.terminate()
    assert all(len(raw.replies[c]) == 1 for c in sent)
    log = node.output()
    assert log.count("(a control character or a non-character)") == 2
    assert "broker disconnected us" not in log and answers.empty()


def test_idempotent_retry_over_mqtt_runs_once(broker, tmp_path):
    node = _slow_node(broker, build_slow_repository(tmp_path / "repo"))
    raw = RawClient(broker)
    x = np.full((1, 4), 3, np.float32)
    key = {"idempotency_key": "edge-1:r1"}
    try:
        first = raw.publish("slow", x, parameters=key)
        second = raw.publish("slow", x, parameters=key)  # while the first runs
        raw.wait_replies([first, second])
        third = raw.publish("slow", x, parameters=key)
        raw.wait_replies([third])
        stats = json.loads(
            urllib.request.urlopen(node.http_url + "/v2/models/slow/stats", timeout=10).read()
        )["model_stats"][0]
    finally:
        raw.close()
        node.terminate()
    answers = [raw.replies[c][0][1] for c in (first, second, third)]
    for a in answers:
        np.testing.assert_array_equal(a.outputs[0].data, answers[0].outputs[0].data)
    assert [bool(a.parameters.get("duplicate")) for a in answers].count(True) == 2
    assert stats["execution_count"] == 1


def test_instance_group_count_two_gives_two_sessions_in_the_node_status(broker, test_repository):
    node = cloud_server(
        test_repository, "--node", "pairs", "--mqtt", broker.url, "--models", "pair,linear"
    ).start()
    raw = RawClient(broker)
    try:
        raw._wait(lambda: any(s["node"] == "pairs" for _, s in raw.statuses), 15, "no status")
        status = next(s for _, s in raw.statuses if s["node"] == "pairs")
    finally:
        raw.close()
        node.terminate()
    by_name = {m["name"]: m for m in status["models"]}
    assert by_name["pair"]["instances"] == 2
    assert by_name["linear"]["instances"] == 1


def test_username_password_and_tls_against_a_secured_broker(tmp_path, test_repository):
    secured = SecuredBroker(tmp_path / "secured")
    secured.start()
    secret = tmp_path / "mqtt-password"
    secret.write_text(secured.password + "\n")
    cfg = tmp_path / "cloud.toml"
    cfg.write_text(
        f'repository = "{test_repository}"\nmodels = ["linear"]\nnode = "tls-node"\n'
        f'[http]\nenabled = false\n[mqtt]\nurl = "{secured.url}"\n'
        f'username = "{secured.username}"\npassword_file = "{secret}"\n'
        f'ca_file = "{secured.ca_file}"\n'
    )
    node = cloud_server(test_repository, "--config", str(cfg)).start()
    try:
        raw = RawClient(
            secured,
            username=secured.username,
            password=secured.password,
            ca_file=secured.ca_file,
        )
        try:
            x = np.ones((2, 4), np.float32)
            c = raw.publish("linear", x)
            raw.wait_replies([c], 20)
        finally:
            raw.close()
        ((_, result),) = raw.replies[c]
        assert not isinstance(result, Exception) and result.parameters["node"] == "tls-node"
        assert result.outputs[0].shape == (2, 3)
        # the broker really checks: without credentials a client is refused
        codes: list = []
        anonymous = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5
        )
        anonymous.tls_set(ca_certs=str(secured.ca_file))
        anonymous.on_connect = lambda c, u, f, reason, props: codes.append(reason)
        anonymous.connect("127.0.0.1", secured.port)
        for _ in range(100):
            anonymous.loop(timeout=0.1)
            if codes:
                break
        anonymous.disconnect()
        assert codes and codes[0].is_failure
    finally:
        node.terminate()
        secured.stop()


def test_broker_restart_every_request_gets_at_most_one_real_reply_and_work_resumes(
    broker, mqtt_server
):
    """Across a broker restart (default non-persistent MQTT sessions):

    - requests published and answered before the broker went down, and every
      request published after both the client and the node re-subscribed, get
      a real reply from the node (never a client-side timeout);
    - no request gets two different answers (a QoS 1 resend may be answered
      twice; both answers are equal, so correlation makes it safe);
    - a request published during the outage window may get no reply at all:
      with clean sessions the broker forgets the node's shared subscription
      and the client's reply subscription when it restarts, so a request the
      client's paho re-sends before the node re-subscribed (or a reply the
      node's paho re-sends before the client re-subscribed) is dropped by the
      broker with no one to deliver it to.  Those are counted, not asserted.
    """
    raw = RawClient(broker)
    sent: list[tuple[float, bytes, float]] = []
    down = up = None
    try:
        t_end = time.monotonic() + 9.0
        restart_at = time.monotonic() + 1.0
        i = 0
        while time.monotonic() < t_end:
            now = time.monotonic()
            if down is None and now >= restart_at:
                down = time.monotonic()
                broker.stop()
                time.sleep(0.5)
                broker.start()
                up = time.monotonic()
            value = float(i % 50 + 1)
            sent.append(
                (time.monotonic(), raw.publish("linear", np.full((1, 4), value, np.float32)), value)
            )
            i += 1
            time.sleep(0.03)
        # the node is back when its fresh "online" status (sent after it re-subscribed) arrives
        raw._wait(
            lambda: any(t > up and s["state"] == "online" for t, s in raw.statuses),
            20,
            "the node never came back",
        )
        node_back = min(t for t, s in raw.statuses if t > up and s["state"] == "online")
        client_back = min(t for t in raw.subscribed_at if t > up)
        settled = max(node_back, client_back)
        # after recovery every request must be answered; give them time
        after = [c for t, c, _ in sent if t > settled]
        raw.wait_replies(after, 30)
        time.sleep(1.0)  # late replies of the outage window, if any
    finally:
        raw.close()
    before = [c for t, c, _ in sent if c in raw.replies and raw.replies[c][0][0] < down]
    assert before, "nothing was answered before the restart"
    assert after, "no request was published after recovery"
    expected_for = {c: v for _, c, v in sent}
    for c, replies in raw.replies.items():
        for _, result in replies:
            assert not isinstance(result, Exception), result
            assert result.outputs[0].data.shape == (1, 3)
        first = replies[0][1].outputs[0].data
        assert all(np.array_equal(r.outputs[0].data, first) for _, r in replies)
        assert c in expected_for
    lost = [c for _, c, _ in sent if c not in raw.replies]
    print(f"{len(sent)} sent, {len(lost)} unanswered (published during the outage window)")


async def test_a_draining_front_answers_every_request_it_received(broker, tmp_path):
    """stop_intake + drain in-process: each received request gets one reply, a result or
    "unavailable"; the drain waits for requests that arrived after it began."""
    from cloud.config import MqttConfig
    from cloud.dataplane import DataPlane
    from cloud.mqtt_front import MqttFront
    from shared.repository import ModelRepository
    from shared.tensors import Limits

    dp = DataPlane(ModelRepository(build_slow_repository(tmp_path / "repo")), "d")
    await dp.load("slow")
    front = MqttFront(dp, MqttConfig(broker=parse_broker_url(broker.url)), Limits(), "d")
    await front.start()
    raw = await asyncio.to_thread(RawClient, broker)
    try:
        await asyncio.sleep(0.3)  # the front's subscription is in place
        sent = [raw.publish("slow", np.full((1, 4), i + 1, np.float32)) for i in range(6)]
        while not front.received:
            await asyncio.sleep(0.01)
        front.stop_intake()
        await front.drain(time.monotonic() + 60)
        assert not front._tasks
        await front.close()
        await asyncio.sleep(1.0)  # replies in transit reach the client
    finally:
        raw.close()
        await dp.close()
    assert front.received > 0 and front.replies_sent + front.refused == front.received
    replies = [raw.replies.get(c, []) for c in sent]
    assert sum(len(r) for r in replies) == front.received
    for i, r in enumerate(replies):
        assert len(r) <= 1
        if r and not isinstance(r[0][1], Exception):
            np.testing.assert_allclose(r[0][1].outputs[0].data, np.full((1, 4), i + 1))
        elif r:
            assert isinstance(r[0][1], ShuttingDown | ModelNotReady)


async def test_requests_still_running_when_the_grace_ends_are_answered_not_dropped(
    broker, tmp_path
):
    """They were acknowledged on receipt (the broker never sends them again): at the
    deadline they had been left without a reply, their senders waiting out their own."""
    from cloud.config import MqttConfig
    from cloud.dataplane import DataPlane
    from cloud.mqtt_front import MqttFront
    from shared.repository import ModelRepository
    from shared.tensors import Limits

    dp = DataPlane(ModelRepository(build_slow_repository(tmp_path / "repo")), "d")
    await dp.load("slow")
    front = MqttFront(dp, MqttConfig(broker=parse_broker_url(broker.url)), Limits(), "d")
    await front.start()
    raw = await asyncio.to_thread(RawClient, broker)
    try:
        await asyncio.sleep(0.3)  # the front's subscription is in place
        sent = [raw.publish("slow", np.full((1, 4), i + 1, np.float32)) for i in range(4)]
        while front.received < len(sent):
            await asyncio.sleep(0.01)
        front.stop_intake()
        await front.drain(time.monotonic() + 0.01)  # the grace ends with all still running
        assert not front._tasks
        await front.close()
        await asyncio.sleep(1.0)  # replies in transit reach the client
    finally:
        raw.close()
        await dp.close()
    replies = [raw.replies.get(c, []) for c in sent]
    assert all(len(r) == 1 for r in replies), replies
    cut = [r[0][1] for r in replies if isinstance(r[0][1], Exception)]
    assert cut and all(isinstance(e, ShuttingDown) and "grace ran out" in str(e) for e in cut)


def _mqtt311(broker, client_id: str, subscribe: str | None = None):
    """A paho MQTT 3.1.1 client, connected (and subscribed): (client, its messages)."""
    import queue

    got: queue.Queue = queue.Queue()
    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=mqtt.MQTTv311,
    )
    client.on_message = lambda c, userdata, message: got.put(message)
    client.connect("127.0.0.1", broker.port)
    client.loop_start()
    if subscribe is not None:
        client.subscribe(subscribe, qos=1)
        time.sleep(0.3)
    return client, got


def _close311(client) -> None:
    client.disconnect()
    client.loop_stop()


def test_an_mqtt_311_client_is_answered_on_the_reply_topic_its_request_names(broker, tmp_path):
    """An MQTT v3.1.1 client has no Response Topic property: it names its reply topic in
    the envelope's parameters (it had no way to be answered).  One that names none is
    not run (it was, and its answer thrown away), and clearing a retained message on a
    request topic is no request at all."""
    import urllib.request

    def named(request_id: str, client_id: str) -> bytes:
        parameters = {"reply_topic": f"ferry/v1/replies/{client_id}"}
        return envelope.encode_request(
            InferRequest(inputs=[Tensor.from_array("x", x)], id=request_id, parameters=parameters)
        )

    node = _slow_node(broker, build_slow_repository(tmp_path / "repo"))
    raw = RawClient(broker)
    clients = []
    try:
        old, answers = _mqtt311(broker, "dev311", "ferry/v1/replies/dev311")
        clients.append(old)
        x = np.ones((1, 4), np.float32)
        bare = envelope.encode_request(InferRequest(inputs=[Tensor.from_array("x", x)], id="v3"))
        old.publish("ferry/v1/models/slow/infer", bare, qos=1).wait_for_publish(5)
        old.publish("ferry/v1/models/slow/infer", b"", qos=1, retain=True).wait_for_publish(5)
        old.publish("ferry/v1/models/slow/infer", named("v3-named", "dev311"), qos=1)
        request_id, reply = envelope.decode_reply(answers.get(timeout=30).payload)
        assert request_id == "v3-named" and reply.outputs[0].data.shape == (1, 4)
        # A second 3.1.1 device is answered on its own topic, and a bare request after
        # a named one is still not served: the first reply topic had been written into
        # the instance every PUBLISH without properties shares, so every later 3.1.1
        # reply (and every status the node sent) went to dev311's topic.
        second, other = _mqtt311(broker, "dev312", "ferry/v1/replies/dev312")
        clients.append(second)
        old.publish("ferry/v1/models/slow/infer", bare, qos=1).wait_for_publish(5)
        second.publish("ferry/v1/models/slow/infer", named("v3-second", "dev312"), qos=1)
        got = other.get(timeout=30)
        assert got.topic == "ferry/v1/replies/dev312"
        assert envelope.decode_reply(got.payload)[0] == "v3-second"
        raw.wait_replies([raw.publish("slow", x)], timeout=30)  # after them, in order
        with urllib.request.urlopen(f"{node.http_url}/v2/models/slow/stats", timeout=10) as r:
            stats = json.loads(r.read())["model_stats"][0]["inference_stats"]
        assert stats["success"]["count"] == 3  # (the named ones and raw's, not the bare ones)
        assert answers.empty()
    finally:
        for client in clients:
            _close311(client)
        raw.close()
        node.terminate()
    said = node.output()
    assert "has no Response Topic (MQTT v5), nor a 'reply_topic' parameter" in said
    assert said.count("not served, no reply") == 2  # (the cleared retained message: none)


def test_requests_not_served_for_their_reply_topic_are_logged_a_few_a_minute(caplog):
    # A client sending them in a loop flooded the node's log.
    import math

    from cloud import mqtt_front

    front = mqtt_front.MqttFront.__new__(mqtt_front.MqttFront)
    front._unserved_window, front._unserved_logged = -math.inf, 0
    for i in range(50):
        front._unserved("request %d not served", i)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == mqtt_front.UNSERVED_LOGS + 1
    assert "counted, not logged" in lines[-1]


class _ReplyWatcher:
    """A paho client on one reply topic, its session kept across a broker restart."""

    def __init__(self, broker, topic: str) -> None:
        self.messages: list[bytes] = []
        self.client = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=f"watch-{uuid.uuid4().hex[:8]}",
            protocol=mqtt.MQTTv5,
        )
        self.client.on_message = lambda c, u, m: self.messages.append(m.payload)
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 300
        self.client.connect("127.0.0.1", broker.port, clean_start=False, properties=props)
        self.client.subscribe(topic, qos=1)
        self.client.loop_start()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


async def _until(check, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _front_and_watcher(tmp_path, extra_conf: str = "", model: bool = False):
    """An in-process MQTT front on a broker of its own (``extra_conf`` appended; its
    sessions saved across a restart), and a watcher of the replies under x/."""
    from cloud.config import MqttConfig
    from cloud.dataplane import DataPlane
    from cloud.mqtt_front import MqttFront
    from shared.repository import ModelRepository
    from shared.tensors import Limits
    from tests.support import Broker

    broker = Broker(tmp_path / "broker")
    if os.geteuid() == 0:  # (Mosquitto drops to its own user, which cannot save the
        # watcher's session under pytest's private folders: it would be gone after a restart)
        extra_conf += "user root\n"
    broker.conf.write_text(broker.conf.read_text() + extra_conf)
    broker.start()
    (tmp_path / "repo").mkdir()
    if model:
        write_linear_model(tmp_path / "repo" / "lin" / "1" / "model.onnx")
    dp = DataPlane(ModelRepository(tmp_path / "repo"), "d")
    if model:
        await dp.load("lin")
    front = MqttFront(dp, MqttConfig(broker=parse_broker_url(broker.url)), Limits(), "d")
    watcher = _ReplyWatcher(broker, "ferry/v1/replies/x/#")
    try:
        await front.start()
        await asyncio.sleep(0.3)
        yield broker, front, watcher
    finally:
        watcher.close()
        await front.close()
        await dp.close()
        broker.stop()


def _x_props():
    from shared.mqtt.codec import PublishProperties

    return PublishProperties(response_topic="ferry/v1/replies/x/1", correlation_data=b"c1")


async def test_an_answer_the_broker_refuses_for_its_size_gets_a_short_error_instead(tmp_path):
    """The answer was dropped without a word (PUBACK 0x95 unread): the requester waited
    out its deadline, and the node counted a success."""
    from shared.messages import InferResponse

    async with _front_and_watcher(tmp_path, "message_size_limit 4000\n") as (_, front, watcher):
        big = InferResponse("m", [Tensor.from_array("y", np.zeros(5000, np.float32))], "1", "r1")
        front._reply(_x_props(), envelope.encode_reply(big))
        await _until(lambda: watcher.messages, "no answer at all")
        rid, answer = envelope.decode_reply(watcher.messages[0])
        assert rid == "r1" and answer.code.value == "payload_too_large", answer
        assert front.refused_replies == 1


async def test_an_answer_whose_connection_broke_is_sent_on_the_next_one(tmp_path):
    """An answer published while the broker was away was lost with no trace."""
    async with _front_and_watcher(tmp_path) as (broker, front, watcher):
        broker.stop()
        await _until(lambda: not front.connected, "the front never saw the broker go")
        answer = envelope.encode_error_reply("r2", InvalidInput("an answer"))
        front._reply(_x_props(), answer)
        broker.start()
        await _until(lambda: watcher.messages, "the held answer never came", 30)
        assert watcher.messages == [answer] and front.resent_replies == 1


async def test_a_held_answer_over_the_new_brokers_packet_size_costs_no_subscription(tmp_path):
    """Resent first thing on reconnect, an answer over a smaller broker's packet size
    raised there: the node stayed connected and subscribed to nothing for good."""
    async with _front_and_watcher(tmp_path, model=True) as (broker, front, watcher):
        broker.stop()
        await _until(lambda: not front.connected, "the front never saw the broker go")
        big = envelope.encode_error_reply("r3", InvalidInput("x" * 20000))
        front._reply(_x_props(), big)
        broker.conf.write_text(
            broker.conf.read_text().replace("max_packet_size 67108864", "max_packet_size 8000")
        )
        broker.start()
        await _until(lambda: watcher.messages, "the requester got no answer at all", 30)
        rid, answer = envelope.decode_reply(watcher.messages[0])
        assert rid == "r3" and "maximum packet size" in str(answer)
        raw = await asyncio.to_thread(RawClient, broker)
        try:
            sent = raw.publish("lin", np.ones((1, 4), np.float32))
            await asyncio.to_thread(raw.wait_replies, [sent], 20)  # still subscribed
        finally:
            raw.close()


@pytest.mark.parametrize("limit", ["max_packet_size 8000", "message_size_limit 8000"])
async def test_a_status_over_the_brokers_packet_size_goes_without_the_models_metadata(
    tmp_path, limit
):
    # It had failed whole: the controller took the node for dead, and every model load
    # failed on the publish.
    import json

    import paho.mqtt.client as paho

    from shared.mqtt import status_topic

    # (a packet size the CONNACK says; a message size it does not, refused by PUBACK 0x95)
    async with _front_and_watcher(tmp_path, limit + "\n", model=True) as (
        broker,
        front,
        _,
    ):
        front.dataplane.status_extras.append(
            lambda: {"metadata": {"lin": {"x": "y" * 20000}}, "configs": {}}
        )
        front.publish_status()  # (no raise)
        seen: list = []
        peer = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2)
        peer.on_message = lambda c, u, m: seen.append(json.loads(m.payload))
        peer.connect("127.0.0.1", broker.port)
        peer.subscribe(status_topic("d"), qos=1)
        peer.loop_start()
        try:
            await _until(lambda: seen, "no status at all")
            status = seen[-1]
            assert status["state"] == "online" and "metadata" not in status
            assert [m["name"] for m in status["models"]] == ["lin"]
        finally:
            peer.loop_stop()
            peer.disconnect()
