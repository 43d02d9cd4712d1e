"""The asyncio MQTT v5 client both tiers use: a thin shell over :class:`ClientSession`.

Why not paho: paho runs its network loop in a thread of its own, so every
message crosses to the event loop and every reply crosses back (two wake-ups
a request), and it copies a payload on receive and again on each partial
send while holding the GIL (measured: a 16 MiB request stalled a node's event
loop by 40-65 ms).  Here the socket lives on the event loop:

- received packets are framed straight into their own buffer
  (:class:`PacketFramer`, an ``asyncio.BufferedProtocol``) and handed to
  ``on_message`` synchronously, on the loop, with no thread hop;
- a PUBLISH is written as a header plus the caller's payload object;
- the connection reconnects by itself (exponential backoff), calls
  ``on_connect`` after each CONNACK (re-subscribe there: sessions are clean)
  and fails every unacknowledged publish or subscription when it drops.

Like everything in :mod:`shared.aio`, it is a shell over a sans-IO core
(:mod:`shared.mqtt`) that both tiers share rather than copy.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import ssl
import sys
import time
from collections.abc import Callable
from typing import Any

from shared.aio.eager import retrieved
from shared.buffered import tail_for
from shared.errors import EndpointUnavailable, Overloaded
from shared.mqtt import codec
from shared.mqtt.codec import (
    Ack,
    Connack,
    Disconnect,
    MalformedPacket,
    Publish,
    PublishProperties,
    SubAck,
    Subscription,
    Will,
)
from shared.mqtt.framing import Oversized, PacketFramer
from shared.mqtt.session import ClientSession, decode
from shared.mqtt.topics import BrokerAddress
from shared.recurring import Recurring

log = logging.getLogger(__name__)

#: a packet longer than this is not held whole (its head is kept; see PacketFramer)
DEFAULT_MAX_PACKET = 64 * 1024 * 1024 + 64 * 1024

OnMessage = Callable[[Publish], None]

#: bytes queued for the broker past which a publish is refused (Overloaded)
MAX_WRITE_BUFFER = 64 << 20


class _Connection(asyncio.BufferedProtocol):
    """One TCP (or TLS) connection to the broker, on the event loop."""

    def __init__(self, client: MqttClient) -> None:
        self.client = client
        self.session = ClientSession()
        loop = asyncio.get_running_loop()
        self.framer = PacketFramer(client.max_packet_bytes, tail=tail_for(loop))
        self.transport: asyncio.Transport | None = None
        self.connack: asyncio.Future[Connack] = loop.create_future()
        # (a connection lost after its CONNACK wait timed out: read, or asyncio logs
        # "Future exception was never retrieved" at ERROR on every such reconnect)
        self.connack.add_done_callback(retrieved)
        self.closed: asyncio.Future[Exception | None] = loop.create_future()
        self.last_read = time.monotonic()
        self.last_write = self.last_read
        self.stalled_since: float | None = None  # the broker stopped taking our bytes
        self.written = 0  # bytes handed to the transport (less its buffer: taken by the kernel)
        self.taken = 0  # what the kernel had taken at the last keepalive tick

    # ---- asyncio.BufferedProtocol ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # DESIGN.md section 2

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.framer.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.last_read = time.monotonic()
        try:
            self.framer.buffer_updated(nbytes)
            packets = self.framer.packets
            while packets:
                item = packets.popleft()
                if isinstance(item, Oversized):
                    self._oversized(item)
                else:
                    self._dispatch(self.session.handle(decode(*item)))
        except MalformedPacket as exc:
            log.warning("MQTT broker sent a malformed packet (%s); reconnecting", exc)
            self.session.disconnect(exc.code)
            self.flush()
            if self.transport is not None:
                self.transport.close()
            return
        self.flush()

    def eof_received(self) -> bool:
        return False  # close our side too

    def pause_writing(self) -> None:
        self.stalled_since = time.monotonic()
        if self.transport is not None:  # (the baseline progress is counted from)
            self.taken = self._taken(self.transport)

    def _taken(self, transport: asyncio.BaseTransport) -> int:
        """Bytes the peer has taken: written, less our buffer and the kernel's send queue
        (over TLS the buffer counts ciphertext: a few bytes more per packet, so only a
        rise is progress)."""
        return self.written - transport.get_write_buffer_size() - _unsent(transport)

    def resume_writing(self) -> None:
        self.stalled_since = None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.connack.done():
            self.connack.set_exception(exc or ConnectionError("connection closed before CONNACK"))
        if not self.closed.done():
            self.closed.set_result(exc)

    # ---- packets -----------------------------------------------------------------------------
    def _dispatch(self, event: Any) -> None:
        if event is None:
            return
        if isinstance(event, Publish):
            self.client._deliver(event)
        elif isinstance(event, (Ack, SubAck)):
            self.client._resolve(event.packet_id, event)
        elif isinstance(event, Connack):
            if not self.connack.done():
                self.connack.set_result(event)
        elif isinstance(event, Disconnect):
            log.warning(
                "MQTT broker disconnected us: reason 0x%02x %s",
                event.reason,
                event.reason_string or "",
            )
            # its session is over: the connection too (it had stayed "connected", and
            # sent publishes the broker would never take, until the socket dropped)
            if self.transport is not None:
                self.transport.close()

    def _oversized(self, item: Oversized) -> None:
        if item.first >> 4 != codec.PUBLISH:
            raise MalformedPacket(f"a {item.length}-byte control packet", codec.PACKET_TOO_LARGE)
        try:
            message = codec.decode_publish(item.first, item.head, truncated=item.length)
        except MalformedPacket:
            log.warning("dropped a %d-byte message whose head cannot be read", item.length)
            return
        self._dispatch(self.session.handle(message))

    def flush(self) -> None:
        outbox = self.session.outbox
        if outbox and self.transport is not None and not self.transport.is_closing():
            for chunk in outbox:
                self.transport.write(chunk)
                self.written += chunk.nbytes if isinstance(chunk, memoryview) else len(chunk)
            self.last_write = time.monotonic()
        outbox.clear()


class MqttClient:
    """An MQTT v5 client that stays connected (see the module docstring)."""

    def __init__(
        self,
        broker: BrokerAddress,
        client_id: str,
        *,
        tls_context: ssl.SSLContext | None = None,
        keepalive_s: int = 30,
        will: Will | None = None,
        max_packet_bytes: int = DEFAULT_MAX_PACKET,
        reconnect_min_s: float = 0.25,
        reconnect_max_s: float = 5.0,
        connect_timeout_s: float = 5.0,
        on_message: OnMessage | None = None,
        on_connect: Callable[[], None] | None = None,
        on_disconnect: Callable[[Exception | None], None] | None = None,
    ) -> None:
        self.broker = broker
        self.client_id = client_id
        self.tls_context = tls_context
        self.keepalive_s = keepalive_s
        self.will = will
        self.max_packet_bytes = max_packet_bytes
        self.reconnect_min_s = reconnect_min_s
        self.reconnect_max_s = reconnect_max_s
        self.connect_timeout_s = connect_timeout_s
        self.on_message = on_message
        self.on_connect = on_connect
        self.on_disconnect = on_disconnect
        self._conn: _Connection | None = None
        self._waiters: dict[int, asyncio.Future[Any] | _Callback] = {}
        self._connected = asyncio.Event()
        #: why the last attempt to connect failed (None once connected): for status pages
        self.last_error: str | None = None
        self._closing = False
        self._runner: asyncio.Task[None] | None = None
        self.connections = 0  # CONNACKs accepted so far
        # A broker that stays away is logged once, then once a minute with a count; its
        # return once (a log whose last MQTT line was a failure read as "still down").
        self._outage = Recurring(log, f"MQTT broker {broker.host}:{broker.port}")

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self, wait_s: float = 5.0) -> bool:
        """Start connecting (and reconnecting); True when connected within ``wait_s``."""
        if self._runner is None:
            self._runner = asyncio.create_task(self._run(), name=f"mqtt {self.client_id}")
        try:
            await asyncio.wait_for(self._connected.wait(), wait_s)
        except TimeoutError:
            return False
        return True

    async def close(self, timeout_s: float = 2.0) -> None:
        """Leave the broker cleanly (DISCONNECT 0: the will is not published)."""
        self._closing = True
        conn = self._conn
        if conn is not None and conn.transport is not None and not conn.transport.is_closing():
            conn.session.disconnect(0)
            conn.flush()
            conn.transport.close()
            try:
                await asyncio.wait_for(asyncio.shield(conn.closed), timeout_s)
            except TimeoutError:
                conn.transport.abort()
        if self._runner is not None:
            self._runner.cancel()
            try:
                await self._runner
            except asyncio.CancelledError:
                pass
            self._runner = None
        self._fail_waiters(EndpointUnavailable("MQTT client closed"))

    def abort(self) -> None:
        """Drop the connection without DISCONNECT (the broker publishes the will); tests."""
        conn = self._conn
        if conn is not None and conn.transport is not None:
            conn.transport.abort()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def stalled(self) -> bool:
        """The broker takes none of the bytes queued for it (see _keepalive)."""
        conn = self._conn
        return conn is not None and conn.stalled_since is not None

    async def wait_connected(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._connected.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    # ---- operations --------------------------------------------------------------------------
    def publish(
        self,
        topic: str,
        payload: Any,
        *,
        qos: int = 1,
        retain: bool = False,
        properties: PublishProperties | None = None,
        track: bool = True,
        on_ack: Callable[[Any], None] | None = None,
    ) -> asyncio.Future[Any] | None:
        """Send a message now; None when not connected (nothing is queued for later).

        With QoS 1 the future resolves on the broker's PUBACK and fails with
        :class:`EndpointUnavailable` if the connection ends first; nobody
        needs to await it, and ``track=False`` makes none (a hot path that
        would never look at it).  ``on_ack`` instead (no future: a hot path's
        cheaper way to hear of a refusal) is called with the PUBACK's reason
        code, or with the error when the connection ends first.
        """
        conn = self._conn
        if conn is None or not self._connected.is_set():
            return None
        transport = conn.transport
        if transport is not None and transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
            # A broker that stopped reading (while still sending) had 156 MB queued here.
            raise Overloaded(
                f"{transport.get_write_buffer_size()} bytes wait to go to the MQTT broker",
                retry_after=1.0,
            )
        packet_id = conn.session.publish(
            topic, payload, qos=qos, retain=retain, properties=properties
        )
        conn.flush()
        if packet_id is None:
            return None
        if on_ack is not None:
            self._waiters[packet_id] = _Callback(on_ack)
            return None
        if not track:
            return None
        return self._waiter(packet_id)

    def subscribe(self, *subscriptions: Subscription | str) -> asyncio.Future[Any]:
        """SUBSCRIBE (a plain string means QoS 1); the future gives the SUBACK's reason codes."""
        conn = self._require()
        subs = [s if isinstance(s, Subscription) else Subscription(s) for s in subscriptions]
        packet_id = conn.session.subscribe(subs)
        conn.flush()
        return self._waiter(packet_id)

    def unsubscribe(self, *topics: str) -> asyncio.Future[Any]:
        conn = self._require()
        packet_id = conn.session.unsubscribe(list(topics))
        conn.flush()
        return self._waiter(packet_id)

    def _require(self) -> _Connection:
        conn = self._conn
        if conn is None or not self._connected.is_set():
            raise EndpointUnavailable(
                f"not connected to MQTT broker {self.broker.host}:{self.broker.port}"
            )
        return conn

    def _waiter(self, packet_id: int) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.add_done_callback(retrieved)
        self._waiters[packet_id] = future
        return future

    def _resolve(self, packet_id: int, event: Ack | SubAck) -> None:
        future = self._waiters.pop(packet_id, None)
        if future is not None and not future.done():
            future.set_result(event.reason if isinstance(event, Ack) else event.reasons)

    def _deliver(self, message: Publish) -> None:
        if self.on_message is None:
            return
        try:
            self.on_message(message)
        except Exception:  # one handler's bug must not drop the connection
            log.exception("MQTT message handler failed on %s", message.topic)

    def _fail_waiters(self, error: Exception) -> None:
        waiters, self._waiters = self._waiters, {}
        for future in waiters.values():
            if not future.done():
                future.set_exception(error)

    # ---- the connection loop -----------------------------------------------------------------
    async def _run(self) -> None:
        delay = self.reconnect_min_s
        while not self._closing:
            started = time.monotonic()
            try:
                await self._connect_once()
            except (OSError, TimeoutError, ConnectionError, RefusedError) as exc:
                self.last_error = str(exc) or type(exc).__name__
                denied = isinstance(exc, RefusedError) and exc.reason in (0x86, 0x87)
                if denied:
                    delay = self.reconnect_max_s  # bad credentials: no point hurrying
                    who = self.broker.username or "(anonymous)"
                    self._outage.failed(
                        f"{self.last_error}; check the user name ({who}) and password this "
                        "process gives the broker",
                        logging.ERROR,
                    )
                else:
                    self._outage.failed(self.last_error)
            except Exception as exc:  # (a host name no resolver takes: UnicodeError ...)
                # the loop had ended for good on these while start() said "retrying"
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._outage.failed(self.last_error, logging.ERROR)
                delay = self.reconnect_max_s
            if self._closing:
                return
            if time.monotonic() - started > self.reconnect_max_s:
                delay = self.reconnect_min_s  # it had been up a while: retry promptly
            await asyncio.sleep(delay * (0.75 + 0.5 * random.random()))
            delay = min(delay * 2, self.reconnect_max_s)

    async def _connect_once(self) -> None:
        loop = asyncio.get_running_loop()
        conn = _Connection(self)
        broker = self.broker
        await asyncio.wait_for(
            loop.create_connection(
                lambda: conn,
                broker.host,
                broker.port,
                ssl=self.tls_context,
                server_hostname=broker.host if self.tls_context else None,
            ),
            self.connect_timeout_s,
        )
        self._conn = conn
        pinger: asyncio.Task[None] | None = None
        up = False
        error: Exception | None = None
        try:
            _raise_if_cancelled()  # (in here: the finally closes the new connection)
            conn.session.outbox.append(
                codec.encode_connect(
                    self.client_id,
                    keepalive_s=self.keepalive_s,
                    username=broker.username,
                    password=broker.password,
                    will=self.will,
                    maximum_packet_size=None,
                )
            )
            conn.flush()
            connack = await asyncio.wait_for(asyncio.shield(conn.connack), self.connect_timeout_s)
            _raise_if_cancelled()
            if connack.reason >= 0x80:
                raise RefusedError(connack.reason)
            keepalive = connack.properties.get(codec.SERVER_KEEP_ALIVE, self.keepalive_s)
            self.connections += 1
            up = True
            self.last_error = None
            self._outage.ok("connected again")
            self._connected.set()
            pinger = asyncio.create_task(self._keepalive(conn, keepalive))
            if self.on_connect is not None:
                try:
                    self.on_connect()
                except Exception:
                    log.exception("MQTT on_connect handler failed")
            error = await asyncio.shield(conn.closed)
        finally:
            self._connected.clear()
            if pinger is not None:
                pinger.cancel()
            if conn.transport is not None and not conn.transport.is_closing():
                conn.transport.abort()
            self._conn = None
            self._fail_waiters(EndpointUnavailable("MQTT connection lost"))
        if up and not self._closing and not self._outage.failing:
            self._outage.since = time.monotonic()  # (lost: its return is logged)
        if up and self.on_disconnect is not None and not self._closing:
            try:
                self.on_disconnect(error)
            except Exception:
                log.exception("MQTT on_disconnect handler failed")

    async def _keepalive(self, conn: _Connection, keepalive_s: int) -> None:
        """PINGREQ when nothing was sent for half the keepalive; drop a silent broker."""
        if not keepalive_s:
            return
        period = keepalive_s / 2
        while True:
            await asyncio.sleep(period / 2)
            now = time.monotonic()
            stalled = conn.stalled_since
            if stalled is not None and conn.transport is not None:
                # a slow link that takes bytes all along is not stalled (a 16 MB upload on
                # a 2 Mbit/s uplink keeps the buffer full for a minute, and moves): what the
                # peer has taken, beyond this buffer and the kernel's send queue
                taken = conn._taken(conn.transport)
                if taken > conn.taken:
                    conn.taken = taken
                    conn.stalled_since = stalled = now
            if stalled is not None and now - stalled > keepalive_s * 1.5:
                # it talks but takes nothing: as good as gone (its chatter had kept the
                # connection "alive" while every byte of ours queued here)
                silent = f"broker took no bytes for {now - stalled:.0f} s: dropped by this client"
                log.warning("MQTT %s; reconnecting", silent)
                if not conn.closed.done():
                    conn.closed.set_result(TimeoutError(silent))
                if conn.transport is not None:
                    conn.transport.abort()
                return
            if now - conn.last_read > keepalive_s * 1.5:
                silent = f"broker silent for {now - conn.last_read:.0f} s: dropped by this client"
                log.warning("MQTT %s; reconnecting", silent)
                if not conn.closed.done():  # (why, for on_disconnect: not "broker closed")
                    conn.closed.set_result(TimeoutError(silent))
                if conn.transport is not None:
                    conn.transport.abort()
                return
            if now - conn.last_write >= period or now - conn.last_read >= period:
                conn.session.ping()
                conn.flush()


def _unsent(transport: asyncio.BaseTransport) -> int:
    """Bytes in the socket's send queue not yet taken by the peer (Linux; else 0, and
    what the kernel took counts as taken)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        import fcntl
        import termios

        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (ImportError, OSError, AttributeError, ValueError):
        return 0
    return int.from_bytes(queued, sys.byteorder, signed=True)


class RefusedError(Exception):
    """The broker answered CONNECT with a failure reason code."""

    def __init__(self, reason: int) -> None:
        why = _CONNACK_REASONS.get(reason)
        super().__init__(f"connection refused, reason 0x{reason:02x}" + (f": {why}" if why else ""))
        self.reason = reason


#: CONNACK reasons an operator meets, said as what to check
_CONNACK_REASONS = {
    0x80: "unspecified error",
    0x84: "unsupported protocol version (the broker needs to speak MQTT v5)",
    0x85: "client identifier not valid",
    0x86: "bad user name or password (check the user name and the password file)",
    0x87: "not authorized (the broker refuses this user)",
    0x88: "server unavailable",
    0x89: "server busy",
    0x8A: "banned",
    0x8C: "bad authentication method",
    0x95: "packet too large",
    0x97: "quota exceeded",
    0x9F: "connection rate exceeded",
}


class _Callback:
    """An ``on_ack`` where a waiter's future would be (the same two ends)."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[Any], None]) -> None:
        self._fn = fn

    def done(self) -> bool:
        return False

    def set_result(self, value: Any) -> None:
        self._call(value)

    def set_exception(self, error: BaseException) -> None:
        self._call(error)

    def _call(self, outcome: Any) -> None:
        try:
            self._fn(outcome)
        except Exception:  # a listener's bug must not break the connection's reader
            log.exception("MQTT publish listener failed")


def _raise_if_cancelled() -> None:
    """Python 3.11's wait_for returns the result when its awaitable finishes in the tick
    its task is cancelled, and the cancel is lost: the connection loop then waited on a
    live connection for good, and asyncio.run's shutdown (a controller whose HTTP port
    could not be bound) hung, deaf to signals."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
