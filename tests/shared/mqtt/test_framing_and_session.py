"""Framing a byte stream into packets, and the client session's bookkeeping."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.mqtt import codec
from shared.mqtt.codec import MalformedPacket
from shared.mqtt.framing import LARGE_BODY, Oversized, PacketFramer
from shared.mqtt.session import ClientSession, PacketTooLarge
from tests.support import feed_held


def publish(topic: str, payload: bytes, packet_id: int | None = None) -> bytes:
    qos = 1 if packet_id else 0
    return codec.publish_header(topic, len(payload), qos=qos, packet_id=packet_id) + payload


def drain(framer: PacketFramer) -> list:
    out = list(framer.packets)
    framer.packets.clear()
    return out


@settings(max_examples=100, deadline=None)
@given(
    payloads=st.lists(st.binary(max_size=300), min_size=1, max_size=6),
    big=st.booleans(),
    cuts=st.lists(st.integers(1, 50_000), max_size=12),
)
def test_any_chunking_of_a_stream_gives_back_the_same_packets(payloads, big, cuts) -> None:
    if big:
        payloads = [*payloads, bytes(range(256)) * (LARGE_BODY // 256 + 3)]
    stream = b"".join(publish(f"t/{i}", p) for i, p in enumerate(payloads))
    framer = PacketFramer(max_packet=1 << 24)
    pos = 0
    for cut in [*cuts, len(stream)]:
        framer.feed(stream[pos : pos + cut])
        pos += cut
    framer.feed(stream[pos:])
    got = [codec.decode_publish(first, body) for first, body in drain(framer)]
    assert [(m.topic, bytes(m.payload)) for m in got] == [
        (f"t/{i}", p) for i, p in enumerate(payloads)
    ]


def test_a_large_body_is_read_into_a_buffer_of_its_own_and_handed_over_whole() -> None:
    payload = b"x" * (3 * LARGE_BODY)
    framer = PacketFramer(max_packet=1 << 24)
    framer.feed(publish("t/big", payload, packet_id=3))
    ((first, body),) = drain(framer)
    assert isinstance(body, bytearray)  # not assembled from pieces: one buffer, no joins
    message = codec.decode_publish(first, body)
    assert message.payload is body and len(message.payload) == len(payload)


def test_a_large_body_is_complete_only_once_the_loop_no_longer_holds_its_buffer() -> None:
    """uvloop keeps the buffer it was handed exported until buffer_updated returns, and
    the client decodes the packets in that call, trimming the body in place."""
    payload = bytes(range(256)) * 1000
    stream = publish("t/big", payload, packet_id=3) + publish("t/next", b"ok")
    framer = PacketFramer(max_packet=1 << 24)
    got: list = []
    feed_held(
        framer, stream, lambda: got.extend(codec.decode_publish(f, b) for f, b in drain(framer))
    )
    assert [(m.topic, bytes(m.payload)) for m in got] == [("t/big", payload), ("t/next", b"ok")]


def test_an_oversized_packet_keeps_its_head_drops_the_rest_and_the_stream_goes_on() -> None:
    framer = PacketFramer(max_packet=10_000, keep_head=4_096)
    big = publish("ferry/v1/models/m/infer", b"\x81\xa2id\xa3abc" + b"z" * 50_000, packet_id=4)
    framer.feed(big + publish("after", b"ok"))
    oversized, (first, body) = drain(framer)
    assert isinstance(oversized, Oversized)
    assert oversized.length == len(big) - 4 and len(oversized.head) == 4_096
    head = codec.decode_publish(oversized.first, oversized.head, truncated=oversized.length)
    assert head.topic == "ferry/v1/models/m/infer"
    assert head.truncated == len(b"\x81\xa2id\xa3abc") + 50_000  # the whole payload's length
    assert codec.decode_publish(first, body).topic == "after"


def test_packet_type_zero_is_malformed() -> None:
    with pytest.raises(MalformedPacket):
        PacketFramer(max_packet=100).feed(b"\x00\x00")


def test_publishes_past_the_brokers_receive_maximum_wait_for_an_acknowledgement() -> None:
    session = ClientSession()
    session.handle(codec.Connack(False, 0, {codec.RECEIVE_MAXIMUM: 2}))
    ids = [session.publish("t", b"x", qos=1) for _ in range(3)]
    assert len(session.outbox) == 2  # the third waits
    session.outbox.clear()
    session.handle(codec.Ack(codec.PUBACK, ids[0]))
    assert len(session.outbox) == 1 and b"t" in session.outbox[0]
    assert session.pending_ids() == ids[1:]


def test_a_publish_over_the_brokers_maximum_packet_size_is_refused_before_sending() -> None:
    session = ClientSession()
    session.handle(codec.Connack(False, 0, {codec.MAXIMUM_PACKET_SIZE: 1000}))
    with pytest.raises(PacketTooLarge):
        session.publish("t", b"x" * 2000, qos=1)
    assert session.outbox == [] and session.pending_ids() == []


def test_a_publish_that_cannot_be_encoded_gives_its_packet_id_back() -> None:
    # A 317-year expiry raised struct.error, which kept its id: 65,535 of them and the
    # node could publish nothing at all.
    session = ClientSession()
    session.handle(codec.Connack(False, 0, {}))
    far = codec.PublishProperties(message_expiry=codec.MAX_EXPIRY_S + 1)
    for _ in range(3):
        with pytest.raises(ValueError, match="message expiry"):
            session.publish("t", b"x", qos=1, properties=far)
    assert session.pending_ids() == [] and session.outbox == []
    assert session.publish("t", b"x", qos=1) is not None


def test_an_expiry_is_whole_seconds_from_one_to_what_four_bytes_hold() -> None:
    assert codec.expiry_s(-5.0) == 1 and codec.expiry_s(0.2) == 1 and codec.expiry_s(2.1) == 3
    assert codec.expiry_s(1e10) == codec.expiry_s(float("inf")) == codec.MAX_EXPIRY_S


def test_an_acknowledgement_nobody_asked_for_is_a_protocol_error() -> None:
    session = ClientSession()
    with pytest.raises(MalformedPacket):
        session.handle(codec.Ack(codec.PUBACK, 42))
    with pytest.raises(MalformedPacket):
        session.handle(codec.SubAck(codec.SUBACK, 42, (1,)))


def test_received_qos1_is_acknowledged_and_qos2_delivered_once() -> None:
    session = ClientSession()
    message = codec.decode_publish(*_split(publish("a", b"1", packet_id=11)))
    assert session.handle(message) is message
    assert session.outbox == [codec.encode_ack(codec.PUBACK, 11)]
    session.outbox.clear()
    first = (codec.PUBLISH << 4) | 4
    body = b"\x00\x01a\x00\x0c\x00two"
    assert session.handle(codec.decode_publish(first, body)) is not None
    assert session.handle(codec.decode_publish(first | 8, body)) is None  # the resend
    assert session.handle(codec.Ack(codec.PUBREL, 12)) is None
    assert session.outbox == [
        codec.encode_ack(codec.PUBREC, 12),
        codec.encode_ack(codec.PUBREC, 12),
        codec.encode_ack(codec.PUBCOMP, 12),
    ]


def test_packet_ids_skip_those_still_in_use() -> None:
    session = ClientSession()
    session._next_id = 65_534
    a = session.publish("t", b"", qos=1)
    b = session.subscribe([codec.Subscription("x")])
    c = session.publish("t", b"", qos=1)
    assert (a, b, c) == (65_535, 1, 2)
    session._next_id = 65_534
    assert session.publish("t", b"", qos=1) == 3  # 65_535, 1 and 2 are taken


def _split(packet: bytes) -> tuple[int, bytes]:
    length, pos = codec.decode_vbi(packet, 1)
    return packet[0], packet[pos : pos + length]


def test_publishes_held_for_the_receive_maximum_are_bounded_and_the_refusal_typed() -> None:
    # A broker that acknowledges nothing had them pile up to the ids' end (a bare
    # RuntimeError then, which no handler took).
    from shared.errors import Overloaded
    from shared.mqtt import session as session_module

    session = ClientSession()
    session.handle(codec.Connack(False, 0, {codec.RECEIVE_MAXIMUM: 1}))
    session.publish("t", b"x", qos=1)  # in flight
    for _ in range(session_module.MAX_WAITING):
        session.publish("t", b"x", qos=1)
    with pytest.raises(Overloaded):
        session.publish("t", b"x", qos=1)
    assert len(session.pending_ids()) == 1 + session_module.MAX_WAITING  # (its id given back)
    session._in_use = set(range(1, 65_536))
    with pytest.raises(Overloaded, match="identifier"):
        session.subscribe([codec.Subscription("x")])


def test_a_control_packet_longer_than_the_limit_is_refused_from_its_header() -> None:
    # It had been read to its end first (256 MB declared: every PINGRESP swallowed).
    framer = PacketFramer(max_packet=1000)
    header = bytes([codec.SUBACK << 4]) + codec.encode_vbi((256 << 20) - 1)
    with pytest.raises(MalformedPacket, match="control packet"):
        framer.feed(header + b"\x00" * 10)
