"""One MQTT v5 client connection's protocol state, without I/O (the aiomqtt v3 shape).

Calls in (``publish``, ``subscribe``, ``handle(packet)``), bytes out
(:attr:`ClientSession.outbox`, buffers the shell writes in order) and events
out (what ``handle`` returns).  It owns what the specification makes the
client's business: packet identifiers, the server's Receive Maximum (QoS 1
publishes beyond it wait their turn here), acknowledgements of received
QoS 1 and 2 messages, and the server's Maximum Packet Size.  Time, sockets,
reconnects and futures are the shell's (:mod:`shared.aio.mqtt`).

A session lives for one network connection: every connection starts clean
(Ferry's workers and agents use session expiry 0, DESIGN.md section 5), so
what was in flight when it ended is the application's to resend.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from shared.errors import Overloaded
from shared.mqtt import codec
from shared.mqtt.codec import (
    PROTOCOL_ERROR,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    SUBACK,
    Ack,
    Connack,
    Disconnect,
    MalformedPacket,
    PingResp,
    Publish,
    PublishProperties,
    SubAck,
    Subscription,
)

#: small PUBLISH payloads are joined to their header (one write, one syscall)
_JOIN_BELOW = 16 * 1024


#: publishes held back by the broker's Receive Maximum, at most (count and bytes): a
#: stock Mosquitto says 20, and a burst of 2,000 small answers must all go (1,024 had
#: refused half of one); the bytes are what bounds the memory
MAX_WAITING = 60_000
MAX_WAITING_BYTES = 64 << 20


def _nbytes(chunks: list[Any]) -> int:
    return sum(c.nbytes if isinstance(c, memoryview) else len(c) for c in chunks)


class PacketTooLarge(ValueError):
    """A PUBLISH longer than the server's Maximum Packet Size (it would close the connection)."""


class ClientSession:
    def __init__(self) -> None:
        self.outbox: list[Any] = []
        self.connected = False
        self.receive_maximum = 65_535
        self.maximum_packet_size: int | None = None
        self.maximum_qos = 2
        self._next_id = 0
        self._in_use: set[int] = set()
        self._unacked: dict[int, int] = {}  # packet id -> packet type awaiting its ack
        self._window = 0  # QoS 1 publishes sent and not yet acknowledged
        self._waiting: deque[tuple[int, list[Any]]] = deque()  # over the Receive Maximum
        self._waiting_bytes = 0
        self._qos2_in: set[int] = set()  # received QoS 2 ids awaiting PUBREL

    # ---- ids ------------------------------------------------------------------------------
    def _packet_id(self) -> int:
        if len(self._in_use) >= 65_535:  # (typed: a bare RuntimeError reached no handler)
            raise Overloaded(
                "every MQTT packet identifier is in use (the broker acknowledges nothing)",
                retry_after=1.0,
            )
        while True:
            self._next_id = self._next_id % 65_535 + 1
            if self._next_id not in self._in_use:
                self._in_use.add(self._next_id)
                return self._next_id

    def _release(self, packet_id: int) -> None:
        self._in_use.discard(packet_id)
        self._unacked.pop(packet_id, None)

    # ---- what the application sends -----------------------------------------------------------
    def publish(
        self,
        topic: str,
        payload: Any,
        *,
        qos: int = 0,
        retain: bool = False,
        properties: PublishProperties | None = None,
    ) -> int | None:
        """Queue a PUBLISH; returns its packet identifier (QoS 1) or None (QoS 0)."""
        if qos not in (0, 1):
            raise ValueError("Ferry publishes with QoS 0 or 1")
        if qos > self.maximum_qos:
            qos = self.maximum_qos  # the server said it takes no more (section 3.2.2.3.4)
        size = len(payload) if not isinstance(payload, memoryview) else payload.nbytes
        packet_id = self._packet_id() if qos else None
        try:
            head = codec.publish_header(
                topic, size, qos=qos, retain=retain, packet_id=packet_id, properties=properties
            )
        except Exception:  # (struct.error too): the id must not leak with the packet
            if packet_id is not None:
                self._release(packet_id)
            raise
        if self.maximum_packet_size and len(head) + size > self.maximum_packet_size:
            if packet_id is not None:
                self._release(packet_id)
            raise PacketTooLarge(
                f"a {len(head) + size}-byte PUBLISH exceeds the broker's maximum packet "
                f"size of {self.maximum_packet_size} bytes"
            )
        chunks = [head + bytes(payload)] if size < _JOIN_BELOW else [head, payload]
        if packet_id is None:
            self.outbox.extend(chunks)
            return None
        self._unacked[packet_id] = PUBACK
        if self._window >= self.receive_maximum:
            # Held for the broker's Receive Maximum; bounded: a broker that acknowledges
            # nothing had them pile up to the packet identifiers' end (20 MB of 200).
            if len(self._waiting) >= MAX_WAITING or self._waiting_bytes + size > MAX_WAITING_BYTES:
                self._release(packet_id)
                raise Overloaded(
                    f"{len(self._waiting)} publishes already wait for the broker's "
                    f"acknowledgements (its Receive Maximum is {self.receive_maximum})",
                    retry_after=1.0,
                )
            self._waiting.append((packet_id, chunks))
            self._waiting_bytes += _nbytes(chunks)
        else:
            self._window += 1
            self.outbox.extend(chunks)
        return packet_id

    def subscribe(self, subscriptions: Sequence[Subscription]) -> int:
        packet_id = self._packet_id()
        self._unacked[packet_id] = SUBACK
        self.outbox.append(codec.encode_subscribe(packet_id, subscriptions))
        return packet_id

    def unsubscribe(self, topics: Sequence[str]) -> int:
        packet_id = self._packet_id()
        self._unacked[packet_id] = codec.UNSUBACK
        self.outbox.append(codec.encode_unsubscribe(packet_id, topics))
        return packet_id

    def ping(self) -> None:
        self.outbox.append(codec.PINGREQ_PACKET)

    def disconnect(self, reason: int = 0) -> None:
        self.outbox.append(codec.encode_disconnect(reason))
        self.connected = False

    def pending_ids(self) -> list[int]:
        """Packet ids still waiting for an acknowledgement (failed when the connection ends)."""
        return list(self._unacked)

    # ---- what the server sends --------------------------------------------------------------
    def handle(self, packet: Any) -> Any:
        """Apply one decoded packet; returns the event the application sees (or None)."""
        if isinstance(packet, Publish):
            return self._on_publish(packet)
        if isinstance(packet, Ack):
            return self._on_ack(packet)
        if isinstance(packet, SubAck):
            if self._unacked.get(packet.packet_id) != packet.kind:
                raise MalformedPacket(f"unexpected acknowledgement of id {packet.packet_id}",
                                      PROTOCOL_ERROR)  # fmt: skip
            self._release(packet.packet_id)
            return packet
        if isinstance(packet, Connack):
            if self.connected:
                raise MalformedPacket("a second CONNACK", PROTOCOL_ERROR)
            if packet.reason < 0x80:
                self.connected = True
                self.receive_maximum = max(packet.receive_maximum, 1)
                self.maximum_packet_size = packet.maximum_packet_size
                self.maximum_qos = packet.maximum_qos
            return packet
        if isinstance(packet, (PingResp, Disconnect)):
            if isinstance(packet, Disconnect):
                self.connected = False
            return packet
        raise MalformedPacket(f"unexpected {type(packet).__name__}", PROTOCOL_ERROR)

    def _on_publish(self, message: Publish) -> Publish | None:
        if message.qos == 1:
            self.outbox.append(codec.encode_ack(PUBACK, message.packet_id))  # type: ignore[arg-type]
            return message
        if message.qos == 2:  # Ferry subscribes with QoS <= 1, but a broker may differ
            packet_id: int = message.packet_id  # type: ignore[assignment]
            self.outbox.append(codec.encode_ack(PUBREC, packet_id))
            if packet_id in self._qos2_in:
                return None  # a resend of one already delivered
            self._qos2_in.add(packet_id)
        return message

    def _on_ack(self, ack: Ack) -> Ack | None:
        if ack.kind == PUBREL:
            self._qos2_in.discard(ack.packet_id)
            self.outbox.append(codec.encode_ack(PUBCOMP, ack.packet_id))
            return None
        if ack.kind != PUBACK or self._unacked.get(ack.packet_id) != PUBACK:
            raise MalformedPacket(f"unexpected acknowledgement of id {ack.packet_id}",
                                  PROTOCOL_ERROR)  # fmt: skip
        self._release(ack.packet_id)
        self._window -= 1
        while self._waiting and self._window < self.receive_maximum:
            _, chunks = self._waiting.popleft()
            self._waiting_bytes -= _nbytes(chunks)
            self._window += 1
            self.outbox.extend(chunks)
        return ack


def decode(first: int, body: Any) -> Any:
    """A server's packet (``codec.decode_packet``), PUBLISH first: it is the hot path."""
    if first >> 4 == PUBLISH:
        return codec.decode_publish(first, body)
    return codec.decode_packet(first, body)
