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
    client = paho.Client(
        callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5
    )
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


async def _fake_broker(after_connack: bytes, read: bool = True, chatter: bool = False):
    """A broker that takes CONNECT, answers CONNACK then ``after_connack``, and from then
    on reads (or not) and, with ``chatter``, says a PINGRESP every 0.2 s."""
    connections: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        await reader.read(1024)  # CONNECT
        writer.write(b"\x20\x03\x00\x00\x00" + after_connack)  # CONNACK v5, success
        await writer.drain()
        try:
            while True:
                if read:
                    if not await reader.read(65536):
                        return
                else:
                    await asyncio.sleep(0.2)
                    if chatter:
                        writer.write(b"\xd0\x00")  # PINGRESP: talks, takes nothing
        except (ConnectionError, asyncio.CancelledError):
            return

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], connections


async def test_a_disconnect_from_the_broker_ends_the_connection() -> None:
    # It had stayed "connected", its publishes going to a session the broker had ended.
    from shared.mqtt import BrokerAddress

    server, port, _ = await _fake_broker(b"\xe0\x02\x8b\x00")  # DISCONNECT 0x8b
    ours = MqttClient(BrokerAddress("127.0.0.1", port), "told-to-go", reconnect_min_s=5)
    lost: list = []
    ours.on_disconnect = lost.append
    try:
        await ours.start()
        await until(lambda: lost, 5)
        assert not ours.connected
    finally:
        await ours.close()
        server.close()


async def test_a_broker_that_talks_but_takes_nothing_is_dropped_and_publishes_refused(
    monkeypatch,
) -> None:
    # Its chatter had kept the connection "alive" while 156 MB queued here.
    from shared.aio import mqtt as mqtt_module
    from shared.errors import Overloaded
    from shared.mqtt import BrokerAddress

    monkeypatch.setattr(mqtt_module, "MAX_WRITE_BUFFER", 1 << 20)
    server, port, _ = await _fake_broker(b"", read=False, chatter=True)
    ours = MqttClient(BrokerAddress("127.0.0.1", port), "stalled", keepalive_s=1, reconnect_min_s=5)
    lost: list = []
    ours.on_disconnect = lost.append
    try:
        assert await ours.start()
        refused = False
        for _ in range(400):
            try:
                ours.publish("t", b"x" * 65536, track=False)
            except Overloaded:
                refused = True
                break
            await asyncio.sleep(0)
        assert refused  # bounded, and said
        await until(lambda: lost, 6)  # and the connection dropped, in 1.5 keepalives
        assert "took no bytes" in str(lost[0])
    finally:
        await ours.close()
        server.close()


async def test_a_slow_broker_that_keeps_taking_bytes_is_not_dropped() -> None:
    # "Stalled" had meant "the buffer stayed full": a 16 MB upload on a slow uplink was
    # cut at 1.5 keepalives, again and again.
    from shared.mqtt import BrokerAddress

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.write(b"\x20\x03\x00\x00\x00")
        await writer.drain()
        try:
            while await reader.read(16384):  # ~320 KB/s: slow, but always taking
                await asyncio.sleep(0.05)
                writer.write(b"\xd0\x00")
        except ConnectionError:
            pass

    import socket

    listener = socket.socket()
    # (a small receive window, as a broker's over a real link: loopback's grows to MBs,
    # and a slow reader's window then opens only seconds apart)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32768)
    listener.bind(("127.0.0.1", 0))
    server = await asyncio.start_server(serve, sock=listener)
    port = listener.getsockname()[1]
    ours = MqttClient(BrokerAddress("127.0.0.1", port), "slow", keepalive_s=1, reconnect_min_s=5)
    lost: list = []
    ours.on_disconnect = lost.append
    try:
        assert await ours.start()
        for _ in range(16):
            ours.publish("t", b"x" * (1 << 20), track=False)  # 16 MB: ~50 s at that rate
        await asyncio.sleep(4)  # past 1.5 keepalives of a full buffer
        assert not lost and ours.connected
    finally:
        await ours.close()
        server.close()
