"""MQTT v5 control packets, encoded and decoded (OASIS MQTT Version 5.0; sans-IO).

Only what a client needs: it writes CONNECT, PUBLISH, PUBACK (and the QoS 2
receiver's PUBREC/PUBCOMP), SUBSCRIBE, UNSUBSCRIBE, PINGREQ and DISCONNECT,
and reads their counterparts.  Every malformed packet raises
:class:`MalformedPacket` with the reason code the specification gives the
fault (0x81 malformed packet, 0x82 protocol error), so the connection can be
closed with that code; nothing here touches a socket.

Payloads are never copied here: a PUBLISH is written as a header plus the
caller's payload object (two buffers for the transport), and read as a
slice of the packet body the framer hands over.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Packet types (the high nibble of the first byte).
CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT, AUTH = range(8, 16)

MALFORMED = 0x81
PROTOCOL_ERROR = 0x82
PACKET_TOO_LARGE = 0x95

# Property identifiers (section 2.2.2.2) by the type of their value.
PAYLOAD_FORMAT, MESSAGE_EXPIRY, CONTENT_TYPE = 0x01, 0x02, 0x03
RESPONSE_TOPIC, CORRELATION_DATA, SUBSCRIPTION_ID = 0x08, 0x09, 0x0B
SESSION_EXPIRY, ASSIGNED_CLIENT_ID, SERVER_KEEP_ALIVE = 0x11, 0x12, 0x13
REASON_STRING, RECEIVE_MAXIMUM, TOPIC_ALIAS_MAXIMUM, TOPIC_ALIAS = 0x1F, 0x21, 0x22, 0x23
MAXIMUM_QOS, RETAIN_AVAILABLE, USER_PROPERTY, MAXIMUM_PACKET_SIZE = 0x24, 0x25, 0x26, 0x27
_BYTE = frozenset({0x01, 0x17, 0x19, 0x24, 0x25, 0x28, 0x29, 0x2A})
_TWO = frozenset({0x13, 0x21, 0x22, 0x23})
_FOUR = frozenset({0x02, 0x11, 0x18, 0x27})
_STRING = frozenset({0x03, 0x08, 0x12, 0x15, 0x1A, 0x1C, 0x1F})
_BINARY = frozenset({0x09, 0x16})
# 0x0B (subscription identifier) is a variable byte integer; 0x26 a string pair.

_H = struct.Struct("!H")
_L = struct.Struct("!L")
MAX_VBI = 268_435_455  # the largest remaining length a packet can declare


class MalformedPacket(ValueError):
    """A packet that breaks the specification; ``code`` is the reason code to close with."""

    def __init__(self, message: str, code: int = MALFORMED) -> None:
        super().__init__(message)
        self.code = code


# ---- primitives ------------------------------------------------------------------------
def encode_vbi(value: int) -> bytes:
    """A variable byte integer (section 1.5.5): 7 bits a byte, high bit = more."""
    if not 0 <= value <= MAX_VBI:
        raise ValueError(f"{value} does not fit a variable byte integer")
    if value < 128:
        return bytes((value,))
    out = bytearray()
    while True:
        value, digit = divmod(value, 128)
        if value:
            out.append(digit | 0x80)
        else:
            out.append(digit)
            return bytes(out)


def decode_vbi(buf: Any, pos: int) -> tuple[int, int]:
    """(value, position after it); raises when the integer runs past 4 bytes or the buffer."""
    value = shift = 0
    for i in range(4):
        if pos + i >= len(buf):
            raise MalformedPacket("variable byte integer runs past the packet")
        byte = buf[pos + i]
        value += (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos + i + 1
        shift += 7
    raise MalformedPacket("variable byte integer longer than 4 bytes")


def _string(text: str) -> bytes:
    data = text.encode("utf-8")
    if len(data) > 0xFFFF:
        raise ValueError("an MQTT string holds at most 65,535 bytes")
    return _H.pack(len(data)) + data


def _binary(data: bytes) -> bytes:
    if len(data) > 0xFFFF:
        raise ValueError("MQTT binary data holds at most 65,535 bytes")
    return _H.pack(len(data)) + bytes(data)


def _read_string(buf: Any, pos: int) -> tuple[str, int]:
    raw, pos = _read_binary(buf, pos)
    try:
        text = str(raw, "utf-8")
    except UnicodeDecodeError:
        raise MalformedPacket("a string is not valid UTF-8") from None
    if "\x00" in text:
        raise MalformedPacket("a string holds U+0000")
    return text, pos


def _read_binary(buf: Any, pos: int) -> tuple[bytes, int]:
    if pos + 2 > len(buf):
        raise MalformedPacket("a length runs past the packet")
    (n,) = _H.unpack_from(buf, pos)
    end = pos + 2 + n
    if end > len(buf):
        raise MalformedPacket("a string or binary field runs past the packet")
    return bytes(buf[pos + 2 : end]), end


def _fixed(first: int, body_length: int) -> bytes:
    return bytes((first,)) + encode_vbi(body_length)


# ---- properties --------------------------------------------------------------------------
def encode_properties(items: Iterable[tuple[int, Any]]) -> bytes:
    """The property block (length + properties) for ``(identifier, value)`` pairs."""
    out = bytearray()
    for ident, value in items:
        out += encode_vbi(ident)
        if ident in _BYTE:
            out.append(value)
        elif ident in _TWO:
            out += _H.pack(value)
        elif ident in _FOUR:
            out += _L.pack(value)
        elif ident in _STRING:
            out += _string(value)
        elif ident in _BINARY:
            out += _binary(value)
        elif ident == USER_PROPERTY:
            out += _string(value[0]) + _string(value[1])
        elif ident == SUBSCRIPTION_ID:
            out += encode_vbi(value)
        else:
            raise ValueError(f"unknown MQTT property 0x{ident:02x}")
    return encode_vbi(len(out)) + bytes(out)


def decode_properties(buf: Any, pos: int) -> tuple[list[tuple[int, Any]], int]:
    """``[(identifier, value)]`` in wire order and the position after the block."""
    length, pos = decode_vbi(buf, pos)
    end = pos + length
    if end > len(buf):
        raise MalformedPacket("properties run past the packet")
    items: list[tuple[int, Any]] = []
    while pos < end:
        ident, pos = decode_vbi(buf, pos)
        if ident in _BYTE:
            if pos >= end:
                raise MalformedPacket("a property runs past its block")
            value: Any = buf[pos]
            pos += 1
        elif ident in _TWO:
            if pos + 2 > end:
                raise MalformedPacket("a property runs past its block")
            (value,) = _H.unpack_from(buf, pos)
            pos += 2
        elif ident in _FOUR:
            if pos + 4 > end:
                raise MalformedPacket("a property runs past its block")
            (value,) = _L.unpack_from(buf, pos)
            pos += 4
        elif ident in _STRING:
            value, pos = _read_string(buf, pos)
        elif ident in _BINARY:
            value, pos = _read_binary(buf, pos)
        elif ident == USER_PROPERTY:
            key, pos = _read_string(buf, pos)
            text, pos = _read_string(buf, pos)
            value = (key, text)
        elif ident == SUBSCRIPTION_ID:
            value, pos = decode_vbi(buf, pos)
        else:
            raise MalformedPacket(f"unknown property 0x{ident:02x}")
        if pos > end:
            raise MalformedPacket("a property runs past its block")
        items.append((ident, value))
    return items, end


#: Message Expiry Interval is a four-byte count of seconds (MQTT v5, 3.3.2.3.3)
MAX_EXPIRY_S = 2**32 - 1


def expiry_s(seconds: float) -> int:
    """A Message Expiry for ``seconds`` left: at least 1 (0 would mean "expired"), at
    most what four bytes hold (a far deadline must not fail the publish)."""
    whole = math.ceil(seconds) if seconds < MAX_EXPIRY_S else MAX_EXPIRY_S
    return whole if whole > 1 else 1


class PublishProperties:
    """The properties a PUBLISH carries that Ferry reads or writes (section 3.3.2.3)."""

    __slots__ = (
        "content_type",
        "correlation_data",
        "message_expiry",
        "payload_format",
        "response_topic",
        "subscription_ids",
        "user_properties",
    )

    def __init__(
        self,
        *,
        response_topic: str | None = None,
        correlation_data: bytes | None = None,
        message_expiry: int | None = None,
        user_properties: Sequence[tuple[str, str]] = (),
        content_type: str | None = None,
        payload_format: int | None = None,
        subscription_ids: tuple[int, ...] = (),
    ) -> None:
        self.response_topic = response_topic
        self.correlation_data = correlation_data
        self.message_expiry = message_expiry
        self.user_properties = tuple(user_properties)
        self.content_type = content_type
        self.payload_format = payload_format
        self.subscription_ids = subscription_ids

    def replaced(self, **changes: Any) -> PublishProperties:
        """A copy with ``changes``: a received message's properties may be the one
        shared empty instance (a PUBLISH without properties decodes to it), which a
        change in place would give every such message, sent and received, from then on."""
        fields = {name: getattr(self, name) for name in self.__slots__}
        fields.update(changes)
        return PublishProperties(**fields)

    def encode(self) -> bytes:
        items: list[tuple[int, Any]] = []
        if self.payload_format is not None:
            items.append((PAYLOAD_FORMAT, self.payload_format))
        if self.message_expiry is not None:
            if not 0 <= self.message_expiry <= MAX_EXPIRY_S:
                raise ValueError(f"message expiry {self.message_expiry} s is not 0..{MAX_EXPIRY_S}")
            items.append((MESSAGE_EXPIRY, self.message_expiry))
        if self.content_type is not None:
            items.append((CONTENT_TYPE, self.content_type))
        if self.response_topic is not None:
            items.append((RESPONSE_TOPIC, self.response_topic))
        if self.correlation_data is not None:
            items.append((CORRELATION_DATA, self.correlation_data))
        items.extend((USER_PROPERTY, pair) for pair in self.user_properties)
        return encode_properties(items) if items else b"\x00"

    @classmethod
    def from_items(cls, items: list[tuple[int, Any]]) -> PublishProperties:
        props = cls()
        users: list[tuple[str, str]] = []
        subs: list[int] = []
        for ident, value in items:
            if ident == RESPONSE_TOPIC:
                props.response_topic = value
            elif ident == CORRELATION_DATA:
                props.correlation_data = value
            elif ident == MESSAGE_EXPIRY:
                props.message_expiry = value
            elif ident == USER_PROPERTY:
                users.append(value)
            elif ident == CONTENT_TYPE:
                props.content_type = value
            elif ident == PAYLOAD_FORMAT:
                props.payload_format = value
            elif ident == SUBSCRIPTION_ID:
                subs.append(value)
            elif ident != TOPIC_ALIAS:
                raise MalformedPacket(f"property 0x{ident:02x} is not allowed in PUBLISH",
                                      PROTOCOL_ERROR)  # fmt: skip
        props.user_properties = tuple(users)
        props.subscription_ids = tuple(subs)
        return props

    def user_property(self, key: str) -> str | None:
        for k, v in self.user_properties:
            if k == key:
                return v
        return None

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{name}={getattr(self, name)!r}"
            for name in self.__slots__
            if getattr(self, name) not in (None, ())
        )
        return f"PublishProperties({fields})"


_NO_PROPS = PublishProperties()


# ---- packets a client writes ----------------------------------------------------------------
@dataclass(frozen=True)
class Will:
    """The message the broker publishes when this client vanishes (section 3.1.3.2)."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


def encode_connect(
    client_id: str,
    *,
    keepalive_s: int,
    clean_start: bool = True,
    session_expiry_s: int = 0,
    receive_maximum: int = 65_535,
    maximum_packet_size: int | None = None,
    username: str | None = None,
    password: str | None = None,
    will: Will | None = None,
) -> bytes:
    flags = 0x02 if clean_start else 0
    props: list[tuple[int, Any]] = []
    if session_expiry_s:
        props.append((SESSION_EXPIRY, session_expiry_s))
    if receive_maximum != 65_535:
        props.append((RECEIVE_MAXIMUM, receive_maximum))
    if maximum_packet_size:
        props.append((MAXIMUM_PACKET_SIZE, maximum_packet_size))
    payload = _string(client_id)
    if will is not None:
        flags |= 0x04 | (will.qos << 3) | (0x20 if will.retain else 0)
        payload += b"\x00" + _string(will.topic) + _binary(will.payload)
    if username is not None:
        flags |= 0x80
        payload += _string(username)
    if password is not None:
        flags |= 0x40
        payload += _binary(password.encode("utf-8"))
    body = b"\x00\x04MQTT\x05" + bytes((flags,)) + _H.pack(keepalive_s) + encode_properties(props)
    body += payload
    return _fixed(CONNECT << 4, len(body)) + body


def topic_name_problem(topic: str) -> str | None:
    """Why ``topic`` is no topic to publish to, or None (MQTT 5 section 4.7.3).

    A PUBLISH to a wildcard, an empty or a NUL-bearing topic is a protocol
    error the broker answers by disconnecting the sender: a client-chosen
    Response Topic must be checked before a reply goes to it, or one bad
    request takes a node (and every request it holds) off the broker.
    """
    if not topic:
        return "it is empty"
    if "+" in topic or "#" in topic:
        return "it holds a wildcard ('+' or '#')"
    if "\x00" in topic:
        return "it holds a NUL character"
    if len(topic.encode("utf-8", "surrogatepass")) > 0xFFFF:
        return "it is longer than 65,535 bytes"
    try:
        topic.encode("utf-8")
    except UnicodeEncodeError:
        return "it is not valid UTF-8"
    # (ASCII first: the full class, with its supplementary-plane non-characters, took
    # 2 us of every publish's header)
    bad = (_DISALLOWED_ASCII if topic.isascii() else _DISALLOWED).search(topic)
    if bad is not None:
        return f"it holds U+{ord(bad.group()):04X} (a control character or a non-character)"
    return None


#: What MQTT 5 section 1.5.4 says a UTF-8 string SHOULD NOT hold and Mosquitto refuses
#: in a topic (mosquitto_validate_utf8) with a disconnect: the C0 and C1 controls and the
#: Unicode non-characters.  One 3.1.1 request naming such a reply topic had the node cut
#: off at every reconnect while it resent the reply.
_DISALLOWED_ASCII = re.compile("[\x01-\x1f\x7f]")
_DISALLOWED = re.compile(
    "[\x01-\x1f\x7f-\x9f\ufdd0-\ufdef"
    + "".join(chr(plane << 16 | low) for plane in range(0x11) for low in (0xFFFE, 0xFFFF))
    + "]"
)


def publish_header(
    topic: str,
    payload_length: int,
    *,
    qos: int = 0,
    retain: bool = False,
    dup: bool = False,
    packet_id: int | None = None,
    properties: PublishProperties | None = None,
) -> bytes:
    """Everything of a PUBLISH but its payload, which the caller writes after it as is."""
    if qos not in (0, 1, 2):
        raise ValueError(f"QoS {qos}")
    problem = topic_name_problem(topic)
    if problem is not None:  # the broker would disconnect us for it
        raise ValueError(f"cannot publish to topic {topic[:200]!r}: {problem}")
    variable = _string(topic)
    if qos:
        if not packet_id:
            raise ValueError("QoS 1 and 2 need a packet identifier")
        variable += _H.pack(packet_id)
    variable += (properties or _NO_PROPS).encode()
    first = (PUBLISH << 4) | (0x08 if dup else 0) | (qos << 1) | (1 if retain else 0)
    return _fixed(first, len(variable) + payload_length) + variable


def encode_ack(kind: int, packet_id: int, reason: int = 0) -> bytes:
    """PUBACK, PUBREC, PUBREL or PUBCOMP (the short form when the reason is success)."""
    first = (kind << 4) | (0x02 if kind == PUBREL else 0)
    if reason == 0:
        return bytes((first, 2)) + _H.pack(packet_id)
    return bytes((first, 3)) + _H.pack(packet_id) + bytes((reason,))


@dataclass(frozen=True)
class Subscription:
    """One topic filter of a SUBSCRIBE with its options (section 3.8.3.1)."""

    topic: str
    qos: int = 1
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0

    def options(self) -> int:
        return (
            self.qos
            | (0x04 if self.no_local else 0)
            | (0x08 if self.retain_as_published else 0)
            | (self.retain_handling << 4)
        )


def encode_subscribe(packet_id: int, subscriptions: Sequence[Subscription]) -> bytes:
    if not subscriptions:
        raise ValueError("SUBSCRIBE needs at least one topic filter")
    body = _H.pack(packet_id) + b"\x00"
    for sub in subscriptions:
        body += _string(sub.topic) + bytes((sub.options(),))
    return _fixed((SUBSCRIBE << 4) | 0x02, len(body)) + body


def encode_unsubscribe(packet_id: int, topics: Sequence[str]) -> bytes:
    if not topics:
        raise ValueError("UNSUBSCRIBE needs at least one topic filter")
    body = _H.pack(packet_id) + b"\x00" + b"".join(_string(t) for t in topics)
    return _fixed((UNSUBSCRIBE << 4) | 0x02, len(body)) + body


PINGREQ_PACKET = bytes((PINGREQ << 4, 0))


def encode_disconnect(reason: int = 0) -> bytes:
    if reason == 0:
        return bytes((DISCONNECT << 4, 0))
    return bytes((DISCONNECT << 4, 1, reason))


# ---- packets a client reads -----------------------------------------------------------------
@dataclass
class Connack:
    session_present: bool
    reason: int
    properties: dict[int, Any] = field(default_factory=dict)

    @property
    def receive_maximum(self) -> int:
        return int(self.properties.get(RECEIVE_MAXIMUM, 65_535))

    @property
    def maximum_packet_size(self) -> int | None:
        return self.properties.get(MAXIMUM_PACKET_SIZE)

    @property
    def maximum_qos(self) -> int:
        return int(self.properties.get(MAXIMUM_QOS, 2))


class Publish:
    """A received PUBLISH; ``payload`` is bytes, or a bytearray for a large one (no copy)."""

    __slots__ = ("dup", "packet_id", "payload", "properties", "qos", "retain", "topic", "truncated")

    def __init__(
        self,
        topic: str,
        payload: Any,
        qos: int,
        retain: bool,
        dup: bool,
        packet_id: int | None,
        properties: PublishProperties,
        truncated: int = 0,
    ) -> None:
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.dup = dup
        self.packet_id = packet_id
        self.properties = properties
        #: when non-zero, the payload's real length: only its head was kept (it was
        #: larger than the client accepts), so the receiver can still answer it
        self.truncated = truncated

    def __repr__(self) -> str:
        return (
            f"Publish({self.topic!r}, {len(self.payload)} B, qos={self.qos}, "
            f"retain={self.retain}, {self.properties!r})"
        )


@dataclass(frozen=True)
class Ack:
    """PUBACK, PUBREC, PUBREL or PUBCOMP."""

    kind: int
    packet_id: int
    reason: int = 0


@dataclass(frozen=True)
class SubAck:
    """SUBACK or UNSUBACK: one reason code per topic filter."""

    kind: int
    packet_id: int
    reasons: tuple[int, ...]


@dataclass(frozen=True)
class Disconnect:
    reason: int
    reason_string: str | None = None


@dataclass(frozen=True)
class PingResp:
    pass


def decode_publish(first: int, body: Any, *, truncated: int = 0) -> Publish:
    """A PUBLISH from its body; a bytearray body is turned into the payload in place.

    ``truncated``: the body is only the head of a packet that long (see
    :class:`~shared.mqtt.framing.Oversized`).
    """
    qos = (first >> 1) & 0x03
    if qos == 3:
        raise MalformedPacket("PUBLISH with QoS 3")
    topic, pos = _read_string(body, 0)
    packet_id = None
    if qos:
        if pos + 2 > len(body):
            raise MalformedPacket("PUBLISH ends before its packet identifier")
        (packet_id,) = _H.unpack_from(body, pos)
        if packet_id == 0:
            raise MalformedPacket("PUBLISH with packet identifier 0")
        pos += 2
    if pos < len(body) and body[pos] == 0:  # the common case: no properties
        props = _NO_PROPS
        pos += 1
    else:
        items, pos = decode_properties(body, pos)
        props = PublishProperties.from_items(items)
    if not topic or "+" in topic or "#" in topic:
        raise MalformedPacket(f"PUBLISH to topic {topic!r}", PROTOCOL_ERROR)
    if isinstance(body, bytearray):
        del body[:pos]  # CPython drops a bytearray's head without moving its bytes
        payload: Any = body
    else:
        payload = body[pos:]
    if truncated:
        truncated -= pos  # the packet's length less its variable header: the payload's
    return Publish(topic, payload, qos, bool(first & 1), bool(first & 8), packet_id, props,
                   truncated)  # fmt: skip


def decode_packet(first: int, body: Any) -> Any:
    """A packet a server sends a client, from its first byte and body."""
    kind = first >> 4
    if kind == PUBLISH:
        return decode_publish(first, body)
    flags = first & 0x0F
    if kind in (PUBACK, PUBREC, PUBREL, PUBCOMP):
        if flags != (0x02 if kind == PUBREL else 0) or len(body) < 2:
            raise MalformedPacket(f"bad acknowledgement packet (type {kind})")
        (packet_id,) = _H.unpack_from(body, 0)
        reason = body[2] if len(body) > 2 else 0
        if len(body) > 3:
            decode_properties(body, 3)
        return Ack(kind, packet_id, reason)
    if flags:
        raise MalformedPacket(f"packet type {kind} with flags {flags:#x}")
    if kind == CONNACK:
        if len(body) < 2 or body[0] & 0xFE:
            raise MalformedPacket("bad CONNACK")
        props: dict[int, Any] = {}
        if len(body) > 2:
            items, _ = decode_properties(body, 2)
            props = {k: v for k, v in items if k != USER_PROPERTY}
        return Connack(bool(body[0] & 1), body[1], props)
    if kind in (SUBACK, UNSUBACK):
        if len(body) < 3:
            raise MalformedPacket("bad SUBACK/UNSUBACK")
        (packet_id,) = _H.unpack_from(body, 0)
        _, pos = decode_properties(body, 2)
        return SubAck(kind, packet_id, tuple(body[pos:]))
    if kind == PINGRESP:
        return PingResp()
    if kind == DISCONNECT:
        reason = body[0] if len(body) else 0
        text = None
        if len(body) > 1:
            items, _ = decode_properties(body, 1)
            text = next((v for k, v in items if k == REASON_STRING), None)
        return Disconnect(reason, text)
    if kind == AUTH:
        raise MalformedPacket("AUTH is not supported (no enhanced authentication)",
                              PROTOCOL_ERROR)  # fmt: skip
    raise MalformedPacket(f"a server does not send packet type {kind}", PROTOCOL_ERROR)


# ---- topics -------------------------------------------------------------------------------------
def topic_matches(pattern: str, topic: str) -> bool:
    """Whether ``topic`` matches the filter ``pattern`` (``+``, ``#``, ``$share/g/``)."""
    if pattern.startswith("$share/"):
        parts = pattern.split("/", 2)
        pattern = parts[2] if len(parts) == 3 else ""
    if pattern == topic:
        return True
    if topic.startswith("$") and not pattern.startswith("$"):
        return False  # wildcards never match $-topics (section 4.7.2)
    p_levels, t_levels = pattern.split("/"), topic.split("/")
    for i, level in enumerate(p_levels):
        if level == "#":
            return True
        if i >= len(t_levels):
            return False
        if level != "+" and level != t_levels[i]:
            return False
    return len(p_levels) == len(t_levels)
