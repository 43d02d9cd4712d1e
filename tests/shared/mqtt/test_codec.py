"""MQTT v5 packets: what is encoded decodes to the same thing; bad bytes raise one type."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.mqtt import codec
from shared.mqtt.codec import MalformedPacket, PublishProperties, Subscription, Will

texts = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00+#/"),
    min_size=1,
    max_size=12,
)
# (a topic holds no control character nor non-character: a broker disconnects for one)
topic_texts = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc", "Cn"), blacklist_characters="+#/"),
    min_size=1,
    max_size=12,
)
topics = st.lists(topic_texts, min_size=1, max_size=4).map("/".join)


def split(packet: bytes) -> tuple[int, bytes]:
    """(first byte, body) of one whole packet."""
    length, pos = codec.decode_vbi(packet, 1)
    assert len(packet) == pos + length
    return packet[0], packet[pos:]


@given(st.integers(0, codec.MAX_VBI))
def test_a_variable_byte_integer_decodes_to_itself(value: int) -> None:
    data = codec.encode_vbi(value)
    assert len(data) <= 4
    assert codec.decode_vbi(data, 0) == (value, len(data))


def test_a_variable_byte_integer_past_four_bytes_is_malformed() -> None:
    with pytest.raises(MalformedPacket):
        codec.decode_vbi(b"\xff\xff\xff\xff\x01", 0)
    with pytest.raises(ValueError):
        codec.encode_vbi(codec.MAX_VBI + 1)


@settings(max_examples=200)
@given(
    topic=topics,
    payload=st.binary(max_size=2000),
    qos=st.sampled_from([0, 1]),
    retain=st.booleans(),
    response=st.none() | topics,
    correlation=st.none() | st.binary(max_size=40),
    expiry=st.none() | st.integers(0, 2**32 - 1),
    users=st.lists(st.tuples(texts, texts), max_size=3),
)
def test_a_publish_decodes_to_what_was_encoded(
    topic, payload, qos, retain, response, correlation, expiry, users
) -> None:
    props = PublishProperties(
        response_topic=response,
        correlation_data=correlation,
        message_expiry=expiry,
        user_properties=users,
    )
    head = codec.publish_header(
        topic, len(payload), qos=qos, retain=retain, packet_id=7 if qos else None, properties=props
    )
    first, body = split(head + payload)
    got = codec.decode_publish(first, body)
    assert (got.topic, bytes(got.payload), got.qos, got.retain) == (topic, payload, qos, retain)
    assert got.packet_id == (7 if qos else None)
    p = got.properties
    assert (p.response_topic, p.correlation_data, p.message_expiry) == (
        response,
        correlation,
        expiry,
    )
    assert list(p.user_properties) == users


def test_a_large_publish_becomes_its_payload_in_place() -> None:
    payload = bytes(range(256)) * 1024
    head = codec.publish_header("t/big", len(payload), qos=1, packet_id=1)
    first, body = split(head + payload)
    buffer = bytearray(body)
    got = codec.decode_publish(first, buffer)
    assert got.payload is buffer and bytes(got.payload) == payload


def test_connect_carries_credentials_will_and_keepalive() -> None:
    packet = codec.encode_connect(
        "dev-1",
        keepalive_s=15,
        username="u",
        password="p\u00e9",
        will=Will("ferry/v1/nodes/a/status", b'{"state":"offline"}'),
    )
    first, body = split(packet)
    assert first == codec.CONNECT << 4
    assert body[:7] == b"\x00\x04MQTT\x05"
    flags = body[7]
    assert flags & 0x80 and flags & 0x40 and flags & 0x04 and flags & 0x20 and flags & 0x02
    assert (flags >> 3) & 3 == 1
    assert body[8:10] == b"\x00\x0f"
    assert b"dev-1" in body and b"ferry/v1/nodes/a/status" in body and "p\u00e9".encode() in body


def test_subscribe_options_and_acks_decode() -> None:
    packet = codec.encode_subscribe(
        9, [Subscription("a/+", qos=1, no_local=True), Subscription("$share/g/b/#", qos=0)]
    )
    first, body = split(packet)
    assert first == (codec.SUBSCRIBE << 4) | 2
    assert body.endswith(b"\x00\x0c$share/g/b/#\x00") and b"a/+\x05" in body
    suback = codec.decode_packet(codec.SUBACK << 4, b"\x00\x09\x00\x01\x00")
    assert suback == codec.SubAck(codec.SUBACK, 9, (1, 0))
    assert codec.decode_packet(codec.PUBACK << 4, b"\x00\x05") == codec.Ack(codec.PUBACK, 5, 0)
    assert codec.decode_packet(codec.PUBACK << 4, b"\x00\x05\x10\x00") == codec.Ack(
        codec.PUBACK, 5, 0x10
    )


def test_connack_reads_the_brokers_limits() -> None:
    props = codec.encode_properties(
        [(codec.RECEIVE_MAXIMUM, 20), (codec.MAXIMUM_PACKET_SIZE, 1 << 20), (codec.MAXIMUM_QOS, 1)]
    )
    connack = codec.decode_packet(codec.CONNACK << 4, b"\x00\x00" + props)
    assert (connack.receive_maximum, connack.maximum_packet_size, connack.maximum_qos) == (
        20,
        1 << 20,
        1,
    )


@pytest.mark.parametrize(
    "first, body",
    [
        ((codec.PUBLISH << 4) | 6, b"\x00\x01t\x00\x01\x00"),  # QoS 3
        (codec.PUBLISH << 4 | 2, b"\x00\x01t\x00\x00\x00"),  # packet id 0
        (codec.PUBLISH << 4, b"\x00\x05t"),  # topic runs past the packet
        (codec.PUBLISH << 4, b"\x00\x01+\x00"),  # wildcard in a topic name
        (codec.PUBLISH << 4, b"\x00\x02\xc3\x28\x00"),  # not UTF-8
        (codec.PUBLISH << 4, b"\x00\x01t\x02\x63\x00"),  # unknown property
        (codec.PUBLISH << 4, b"\x00\x01t\x05\x02\x00\x00"),  # property past its block
        (codec.PUBLISH << 4, b"\x00\x01t\x03\x11\x00\x00"),  # property not for PUBLISH
        (codec.CONNACK << 4, b"\x02\x00"),  # reserved ack flags
        (codec.PUBACK << 4 | 1, b"\x00\x01"),  # bad flags
        (codec.AUTH << 4, b"\x00"),
        (codec.CONNECT << 4, b""),  # a server never sends CONNECT
    ],
)
def test_a_malformed_packet_raises_malformed_packet(first: int, body: bytes) -> None:
    with pytest.raises(MalformedPacket):
        codec.decode_packet(first, body)


@settings(max_examples=500)
@given(st.integers(0, 255), st.binary(max_size=64))
def test_random_bytes_never_raise_anything_but_malformed_packet(first: int, body: bytes) -> None:
    try:
        codec.decode_packet(first, body)
    except MalformedPacket:
        pass


@pytest.mark.parametrize(
    "pattern, topic, matches",
    [
        ("a/b", "a/b", True),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/#", "a", True),
        ("a/#", "a/b/c", True),
        ("+/+", "a/b", True),
        ("#", "$SYS/x", False),
        ("$share/ferry/ferry/v1/models/m/infer", "ferry/v1/models/m/infer", True),
        ("ferry/v1/nodes/+/status", "ferry/v1/nodes/n1/status", True),
        ("ferry/v1/nodes/+/status", "ferry/v1/placement", False),
    ],
)
def test_topic_filters_match_as_the_specification_says(pattern, topic, matches) -> None:
    assert codec.topic_matches(pattern, topic) is matches


@pytest.mark.parametrize(
    ("topic", "problem"),
    [
        ("ferry/v1/replies/+/x", "wildcard"),
        ("ferry/v1/replies/#", "wildcard"),
        ("", "empty"),
        ("a\x00b", "NUL"),
        ("t" * 65_536, "65,535"),
        # Mosquitto refuses these too (mosquitto_validate_utf8), with a disconnect
        ("ferry/v1/replies/edge-8/\x01", "U+0001"),
        ("a\x7f", "U+007F"),
        ("a\u0085", "U+0085"),
        ("a\ufdd0", "U+FDD0"),
        ("a\ufffe", "U+FFFE"),
        ("a\U0010ffff", "U+10FFFF"),
    ],
)
def test_no_publish_goes_to_a_topic_the_broker_would_disconnect_us_for(topic, problem) -> None:
    assert problem in (codec.topic_name_problem(topic) or "")
    with pytest.raises(ValueError, match=re.escape(problem)):
        codec.publish_header(topic, 0)
    assert codec.topic_name_problem("ferry/v1/replies/edge-7") is None
    assert codec.topic_name_problem("$share/g/x") is None
    assert codec.topic_name_problem("ferry/v1/replies/é/漢字/\U0001f600") is None
