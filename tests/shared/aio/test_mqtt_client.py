"""Ferry's asyncio MQTT v5 client against a real Mosquitto, with paho as the other peer."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import paho.mqtt.client as paho
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from shared.aio.mqtt import MqttClient
from shared.mqtt import parse_broker_url
from shared.mqtt.codec import Publish, PublishProperties, Subscription, Will
from tests.support import Broker


def paho_client(broker: Broker, messages: list | None = None) -> paho.Client:
    client = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    if messages is not None:
        client.on_message = lambda c, u, m: messages.append(m)
    client.connect("127.0.0.1", broker.port)
    client.loop_start()
    return client


async def until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_messages_and_their_properties_cross_between_ferry_and_paho(broker: Broker) -> None:
    got: list[Publish] = []
    ours = MqttClient(parse_broker_url(broker.url), "ours", on_message=got.append)
    assert await ours.start()
    assert await ours.subscribe("in/#") == (1,)
    seen: list = []
    peer = paho_client(broker, seen)
    try:
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = "out/reply"
        props.CorrelationData = b"\x00corr"
        props.MessageExpiryInterval = 9
        props.UserProperty = [("k", "v")]
        await asyncio.to_thread(
            lambda: peer.publish("in/a", b"hello", qos=1, properties=props).wait_for_publish(5)
        )
        await until(lambda: got)
        p = got[0].properties
        assert (got[0].topic, got[0].payload, got[0].qos) == ("in/a", b"hello", 1)
        assert (p.response_topic, p.correlation_data, p.message_expiry) == (
            "out/reply",
            b"\x00corr",
            9,
        )
        assert p.user_properties == (("k", "v"),)

        peer.subscribe("out/#", qos=1)
        await asyncio.sleep(0.3)
        reason = await ours.publish(
            "out/reply",
            b"answer",
            properties=PublishProperties(correlation_data=b"\x00corr", response_topic="x"),
        )
        assert reason == 0  # the broker's PUBACK
        await until(lambda: seen)
        assert seen[0].payload == b"answer"
        assert seen[0].properties.CorrelationData == b"\x00corr"
    finally:
        peer.loop_stop()
        await ours.close()


async def test_a_16_mib_message_arrives_whole_and_a_larger_one_as_its_head(broker: Broker) -> None:
    got: list[Publish] = []
    ours = MqttClient(
        parse_broker_url(broker.url), "big", on_message=got.append, max_packet_bytes=20 << 20
    )
    assert await ours.start()
    await ours.subscribe("big/#")
    peer = paho_client(broker)
    try:
        payload = os.urandom(1 << 20) * 16
        too_big = b"\x81\xa2id\xa2r9" + bytes(24 << 20)
        for topic, data in (("big/ok", payload), ("big/no", too_big), ("big/after", b"1")):
            await asyncio.to_thread(
                lambda t=topic, d=data: peer.publish(t, d, qos=1).wait_for_publish(30)
            )
        await until(lambda: len(got) == 3, 30)
        ok, no, after = got
        assert bytes(ok.payload) == payload and not ok.truncated
        assert no.truncated == len(too_big) and len(no.payload) < 100_000
        assert bytes(no.payload).startswith(b"\x81\xa2id\xa2r9")
        assert after.payload == b"1"
    finally:
        peer.loop_stop()
        await ours.close()


async def test_the_will_is_published_when_the_connection_drops_not_on_close(
    broker: Broker,
) -> None:
    seen: list = []
    watcher = paho_client(broker, seen)
    watcher.subscribe("wills/#", qos=1)
    url = parse_broker_url(broker.url)
    try:
        await asyncio.sleep(0.2)
        polite = MqttClient(url, "polite", will=Will("wills/polite", b"gone", retain=False))
        rude = MqttClient(url, "rude", will=Will("wills/rude", b"gone", retain=False))
        assert await polite.start() and await rude.start()
        await polite.close()
        rude.abort()
        await until(lambda: any(m.topic == "wills/rude" for m in seen))
        await asyncio.sleep(0.3)
        assert [m.topic for m in seen] == ["wills/rude"]
        await rude.close()
    finally:
        watcher.loop_stop()


async def test_it_reconnects_after_a_broker_restart_and_subscribes_again(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "shared.aio.mqtt")
    got: list[Publish] = []
    ours = MqttClient(
        parse_broker_url(broker.url), "again", on_message=got.append, reconnect_max_s=0.5
    )
    ours.on_connect = lambda: ours.subscribe("re/#")
    disconnects: list = []
    ours.on_disconnect = disconnects.append
    assert await ours.start()
    await asyncio.sleep(0.2)
    pending = ours.publish("elsewhere", b"x" * 10)
    await asyncio.to_thread(broker.restart, 0.3)
    await until(lambda: ours.connections == 2, 10)
    assert disconnects and (pending is None or pending.done())
    # its return is said (the log's last MQTT line had been the failure: "still down")
    assert any("connected again" in r.getMessage() for r in caplog.records)
    await asyncio.sleep(0.2)
    peer = paho_client(broker)
    try:
        await asyncio.to_thread(lambda: peer.publish("re/1", b"back", qos=1).wait_for_publish(5))
        await until(lambda: got)
        assert got[0].payload == b"back"
    finally:
        peer.loop_stop()
        await ours.close()


async def test_a_shared_subscription_spreads_messages_over_its_members(broker: Broker) -> None:
    url = parse_broker_url(broker.url)
    counts = {"a": 0, "b": 0}

    def counter(name: str):
        def on(message: Publish) -> None:
            counts[name] += 1

        return on

    a = MqttClient(url, "member-a", on_message=counter("a"))
    b = MqttClient(url, "member-b", on_message=counter("b"))
    assert await a.start() and await b.start()
    await a.subscribe(Subscription("$share/g/work/+"))
    await b.subscribe(Subscription("$share/g/work/+"))
    sender = MqttClient(url, "sender")
    assert await sender.start()
    try:
        await asyncio.gather(*(sender.publish(f"work/{i}", b"job") for i in range(40)))
        await until(lambda: counts["a"] + counts["b"] == 40)
        assert counts["a"] > 0 and counts["b"] > 0
    finally:
        for c in (a, b, sender):
            await c.close()


async def test_a_silent_broker_is_noticed_by_the_keepalive(broker: Broker) -> None:
    ours = MqttClient(parse_broker_url(broker.url), "keepalive", keepalive_s=1)
    lost: list = []
    ours.on_disconnect = lost.append
    assert await ours.start()
    assert broker.proc is not None
    os.kill(broker.proc.pid, signal.SIGSTOP)
    try:
        await until(lambda: lost, 6)
        assert not ours.connected
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
    await until(lambda: ours.connected, 10)
    await ours.close()


async def test_an_unreachable_broker_leaves_the_client_retrying_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "shared.aio.mqtt")
    ours = MqttClient(
        parse_broker_url("mqtt://127.0.0.1:9"),
        "nobody",
        reconnect_min_s=0.05,
        reconnect_max_s=0.05,
    )
    assert await ours.start(0.5) is False
    assert ours.publish("t", b"x") is None
    assert ours._outage.count > 2
    # once, not once per attempt (a broker outage had logged a line every few seconds)
    assert len([r for r in caplog.records if "127.0.0.1:9" in r.getMessage()]) == 1
    await ours.close()


async def test_a_host_name_no_resolver_takes_leaves_the_client_retrying_not_dead() -> None:
    """A UnicodeError from the resolver had ended the connection loop for good, while
    start() said it was retrying in the background."""
    label = "x" * 64  # a DNS label of over 63 characters: the idna codec refuses it
    ours = MqttClient(
        parse_broker_url(f"mqtt://{label}.example:1883"),
        "nobody",
        reconnect_min_s=0.05,
        reconnect_max_s=0.05,
    )
    assert await ours.start(0.3) is False
    await asyncio.sleep(0.2)
    assert ours._runner is not None and not ours._runner.done()
    await ours.close()
