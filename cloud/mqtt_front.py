"""The cloud node's MQTT v5 front: shared subscriptions in, replies out.

paho-mqtt runs its network loop in its own thread; each message is handed to
the asyncio loop with ``call_soon_threadsafe`` and answered from there on the
request's Response Topic with its Correlation Data.  Message Expiry becomes
the request's deadline.  paho reconnects by itself; ``on_connect``
re-subscribes, so a broker restart needs nothing from the operator.

Backpressure: at most ``max_inflight`` requests, and at most the node's byte
budget (shared with the HTTP front), may be received and not yet answered.  The count is taken on paho's thread, before the message is handed
to the loop or decoded, so a flood costs one "overloaded" error reply per
message (with ``retry_after_ms``) instead of unbounded memory.

Invariants: only the event loop touches ``_subscribed`` and ``_tasks``;
every received request gets exactly one reply (a result or a typed error),
also while the node shuts down ("unavailable").
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from cloud.admission import ByteBudget
from cloud.config import MqttConfig
from cloud.dataplane import DataPlane
from shared import envelope
from shared.errors import FerryError, InternalError, InvalidInput, Overloaded, ShuttingDown
from shared.mqtt import (
    PREFIX,
    BrokerAddress,
    model_from_topic,
    nodelay,
    reply_principal,
    shared_request_topic,
    status_topic,
)
from shared.tensors import Limits
from shared.tls import client_tls_context

log = logging.getLogger(__name__)



def new_client(
    broker: BrokerAddress,
    client_id: str,
    *,
    ca_file: Path | None = None,
    insecure: bool = False,
    cert_file: Path | None = None,
    key_file: Path | None = None,
) -> mqtt.Client:
    """A paho MQTT v5 client for the cloud tier (node, controller, ``fleet``): the
    broker's credentials and TLS, Nagle off."""
    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=mqtt.MQTTv5,
    )
    if broker.username:
        client.username_pw_set(broker.username, broker.password)
    if broker.tls:
        client.tls_set_context(
            client_tls_context(ca_file, insecure=insecure, cert_file=cert_file, key_file=key_file)
        )
    client.on_socket_open = nodelay
    return client


#: replies above this are handed to paho from a worker thread (it copies them whole)
_PUBLISH_WORKER_BYTES = 1 << 20
#: user property a node puts on a request it forwards (such a request is not forwarded again)
FORWARDED = "ferry-forwarded-by"
_REQUEST_HEAD = f"{PREFIX}/models/"
#: Retry-After hint for a refused MQTT request when the model's own queue gives none
_DEFAULT_RETRY_S = 0.1


class MqttFront:
    def __init__(
        self,
        dataplane: DataPlane,
        config: MqttConfig,
        limits: Limits,
        node: str,
        *,
        max_inflight: int = 0,
        budget: ByteBudget | None = None,
    ) -> None:
        self.dataplane = dataplane
        self.config = config
        self.limits = limits
        self.node = node
        self.client_id = config.client_id or f"ferry-cloud-{node}"
        self.max_inflight = max_inflight
        self._slots = threading.BoundedSemaphore(max_inflight) if max_inflight else None
        self.budget = budget or ByteBudget(0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: mqtt.Client | None = None
        self._subscribed: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._status_task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._accepting = True  # False once intake stopped: late requests get "unavailable"
        self._closed = False
        #: topic filter -> callable(topic, payload, properties) run on the loop (fleet
        #: messages: placement, node status, forwarded replies)
        self._handlers: dict[str, Any] = {}
        #: loaded models whose request topic is withheld (being moved away)
        self._withheld: set[str] = set()
        self._unsub_waiters: dict[int, asyncio.Future[None]] = {}
        self._per_model: dict[str, int] = {}  # requests being handled, per model
        self.received = 0  # requests paho handed over (paho's thread writes it)
        self.replies_sent = 0
        self.refused = 0

    # ---- lifecycle --------------------------------------------------------------
    async def start(self, wait_s: float = 5.0) -> None:
        self._loop = asyncio.get_running_loop()
        broker = self.config.broker
        client = new_client(
            broker,
            self.client_id,
            ca_file=self.config.ca_file,
            insecure=self.config.tls_insecure,
            cert_file=self.config.cert_file,
            key_file=self.config.key_file,
        )
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_unsubscribe = self._on_unsubscribe
        client.reconnect_delay_set(min_delay=1, max_delay=5)
        client.will_set(
            status_topic(self.node),
            json.dumps({"node": self.node, "state": "offline"}),
            qos=1,
            retain=True,
        )
        self._client = client
        self.dataplane.on_models_changed.append(self._models_changed)
        client.connect_async(broker.host, broker.port, keepalive=self.config.keepalive_s)
        client.loop_start()
        try:
            await asyncio.wait_for(self._connected.wait(), wait_s)
        except TimeoutError:
            log.warning(
                "MQTT broker %s:%s not reachable yet; retrying in the background",
                broker.host,
                broker.port,
            )
        self._status_task = asyncio.create_task(self._status_loop())

    def stop_intake(self) -> None:
        """Unsubscribe; requests that still arrive get an "unavailable" reply."""
        self._accepting = False
        if self._models_changed in self.dataplane.on_models_changed:
            self.dataplane.on_models_changed.remove(self._models_changed)
        client = self._client
        if client is not None:
            for topic in sorted(self._subscribed):
                client.unsubscribe(topic)
        self._subscribed.clear()

    async def drain(self, deadline: float) -> None:
        """Wait (until the monotonic ``deadline``) for every request received so far,
        including those that arrived after intake stopped."""
        while self._tasks:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning(
                    "MQTT drain: %d requests still running at the deadline", len(self._tasks)
                )
                return
            await asyncio.wait(list(self._tasks), timeout=remaining)
            await asyncio.sleep(0)  # let messages already handed over spawn their tasks

    async def close(self, timeout_s: float = 2.0) -> None:
        """Publish the offline status (waiting at most ``timeout_s``) and leave the broker."""
        self._closed = True
        if self._status_task is not None:
            self._status_task.cancel()
        client = self._client
        if client is not None:
            info = client.publish(
                status_topic(self.node),
                json.dumps({"node": self.node, "state": "offline"}),
                qos=1,
                retain=True,
            )
            await asyncio.to_thread(wait_published, info, timeout_s)
            client.disconnect()
            await asyncio.to_thread(client.loop_stop)

    async def stop(self, grace_s: float = 30.0) -> None:
        """Stop taking requests, answer those in flight, then leave the broker."""
        self.stop_intake()
        await self.drain(time.monotonic() + grace_s)
        await self.close()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    # ---- paho callbacks (network thread) ------------------------------------------
    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any
    ) -> None:
        if reason.is_failure:
            log.warning("MQTT connect refused: %s", reason)
            return
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._after_connect)

    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any
    ) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._connected.clear)
        if self._accepting:
            log.warning("MQTT disconnected (%s); paho reconnects", reason)

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        received = time.monotonic()
        if self._closed or self._loop is None:
            return
        if not message.topic.startswith(_REQUEST_HEAD):
            self._route(message)
            return
        self.received += 1
        if self._slots is not None and not self._slots.acquire(blocking=False):
            model = model_from_topic(message.topic)
            hint = self.dataplane.retry_hint(model) or _DEFAULT_RETRY_S
            self._refuse(
                client,
                message,
                Overloaded(
                    f"node {self.node}: {self.max_inflight} MQTT requests in flight",
                    retry_after=hint,
                ),
            )
            return
        size = len(message.payload)
        if not self.budget.try_take(size):
            if self._slots is not None:
                self._slots.release()
            self._refuse(client, message, self.budget.overloaded(size))
            return
        try:
            self._loop.call_soon_threadsafe(self._spawn, message, received, size)
        except RuntimeError:  # the loop is closed: the node is gone
            self.budget.give(size)
            if self._slots is not None:
                self._slots.release()

    def _route(self, message: mqtt.MQTTMessage) -> None:
        """A fleet message: hand it to the handler of the first filter that matches."""
        for pattern, handler in list(self._handlers.items()):
            if mqtt.topic_matches_sub(pattern, message.topic):
                try:
                    self._loop.call_soon_threadsafe(  # type: ignore[union-attr]
                        handler, message.topic, message.payload, message.properties
                    )
                except RuntimeError:  # the loop is closed
                    pass
                return

    def _on_unsubscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, reasons: Any, props: Any
    ) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._unsubscribed, mid)

    def _unsubscribed(self, mid: int) -> None:
        waiter = self._unsub_waiters.pop(mid, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _refuse(self, client: mqtt.Client, message: mqtt.MQTTMessage, error: FerryError) -> None:
        """Answer without decoding the tensors (on paho's thread: publish is thread-safe)."""
        self.refused += 1
        response_topic = getattr(message.properties, "ResponseTopic", None)
        if not response_topic:
            return
        request_id = envelope.peek_request_id(message.payload) or ""
        out = Properties(PacketTypes.PUBLISH)
        correlation = getattr(message.properties, "CorrelationData", None)
        if correlation is not None:
            out.CorrelationData = correlation
        client.publish(
            response_topic, envelope.encode_error_reply(request_id, error), qos=1, properties=out
        )

    # ---- on the event loop ----------------------------------------------------------
    def _after_connect(self) -> None:
        self._connected.set()
        self._subscribed.clear()  # a new connection starts with no subscriptions
        for pattern in sorted(self._handlers):
            self._client.subscribe(pattern, qos=1)  # type: ignore[union-attr]
        self._sync_subscriptions()
        self._publish_status()

    # ---- fleet hooks (the placement follower and the forwarder) -----------------------
    def add_handler(self, pattern: str, handler: Any) -> None:
        """Deliver messages on ``pattern`` to ``handler(topic, payload, properties)`` on
        the loop; subscribed now and after every reconnect."""
        self._handlers[pattern] = handler
        if self._client is not None and self._connected.is_set():
            self._client.subscribe(pattern, qos=1)

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        retain: bool = False,
        properties: Properties | None = None,
    ) -> mqtt.MQTTMessageInfo:
        assert self._client is not None
        return self._client.publish(topic, payload, qos=1, retain=retain, properties=properties)

    @property
    def username(self) -> str | None:
        return self.config.broker.username

    def publish_status(self) -> None:
        """Publish the node's status now (after a placement step, say)."""
        if self._connected.is_set():
            self._publish_status()

    async def withhold(self, name: str, timeout_s: float = 5.0) -> None:
        """Stop taking ``name``'s requests from the broker: unsubscribe its shared topic
        and wait for the broker's acknowledgement (after it, no new request for it
        reaches this node), then for the requests already received to finish."""
        self._withheld.add(name)
        topic = shared_request_topic(name)
        client = self._client
        if client is not None and topic in self._subscribed:
            self._subscribed.discard(topic)
            assert self._loop is not None
            waiter: asyncio.Future[None] = self._loop.create_future()
            rc, mid = client.unsubscribe(topic)
            if rc == mqtt.MQTT_ERR_SUCCESS:
                self._unsub_waiters[mid] = waiter
                try:
                    await asyncio.wait_for(waiter, timeout_s)
                except TimeoutError:
                    log.warning("no UNSUBACK for %s within %.1f s", topic, timeout_s)
                finally:
                    self._unsub_waiters.pop(mid, None)
        deadline = time.monotonic() + timeout_s
        while self._per_model.get(name, 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def release(self, name: str) -> None:
        """Take ``name``'s requests again once it is loaded (undoes :meth:`withhold`)."""
        self._withheld.discard(name)
        if self._connected.is_set():
            self._sync_subscriptions()

    def _models_changed(self) -> None:
        if self._connected.is_set():
            self._sync_subscriptions()
            self._publish_status()

    def _sync_subscriptions(self) -> None:
        if self._client is None or not self._accepting:
            return
        wanted = {
            shared_request_topic(name)
            for name in self.dataplane.loaded_names()
            if name not in self._withheld
        }
        for topic in sorted(wanted - self._subscribed):
            self._client.subscribe(topic, qos=1)
        for topic in sorted(self._subscribed - wanted):
            self._client.unsubscribe(topic)
        self._subscribed = wanted

    def _spawn(self, message: mqtt.MQTTMessage, received: float, size: int) -> None:
        task = asyncio.create_task(self._handle(message, received))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._task_done(t, size))

    def _task_done(self, task: asyncio.Task[None], size: int) -> None:
        self._tasks.discard(task)
        self.budget.give(size)
        if self._slots is not None:
            self._slots.release()

    async def _handle(self, message: mqtt.MQTTMessage, received: float) -> None:
        model = model_from_topic(message.topic)
        key = model or ""
        self._per_model[key] = self._per_model.get(key, 0) + 1
        try:
            await self._answer(message, received, model)
        finally:
            left = self._per_model[key] - 1
            if left:
                self._per_model[key] = left
            else:
                del self._per_model[key]

    async def _answer(self, message: mqtt.MQTTMessage, received: float, model: str | None) -> None:
        props = message.properties
        response_topic = getattr(props, "ResponseTopic", None)
        correlation = getattr(props, "CorrelationData", None)
        expiry = getattr(props, "MessageExpiryInterval", None)
        deadline = received + expiry if expiry else None
        payload = message.payload
        request_id = None
        try:
            if not self._accepting:
                raise ShuttingDown(f"node {self.node} is shutting down")
            if model is None:
                raise InvalidInput(f"not a request topic: {message.topic!r}")
            forwarded = any(k == FORWARDED for k, _ in getattr(props, "UserProperty", None) or ())
            if not forwarded:  # an unknown model is refused before decoding
                self.dataplane.check_servable(model, None)
            if envelope.decode_needs_worker(payload):  # big or BYTES: off the loop
                request = await asyncio.to_thread(envelope.decode_request, payload, self.limits)
            else:
                request = envelope.decode_request(payload, self.limits)
            request_id = request.id
            # the reply topic names the sender (the broker's ACLs keep it to its owner)
            response = await self.dataplane.infer(
                model,
                request,
                deadline=deadline,
                principal=reply_principal(response_topic),
                forwardable=not forwarded,
            )
            if envelope.encode_needs_worker(response):
                reply = await asyncio.to_thread(envelope.encode_reply, response)
            else:
                reply = envelope.encode_reply(response)
        except FerryError as exc:
            request_id = request_id or envelope.peek_request_id(payload) or ""
            reply = envelope.encode_error_reply(request_id, exc)
        except Exception:  # never let one message take the front down
            log.exception("MQTT request failed")
            request_id = request_id or envelope.peek_request_id(payload) or ""
            # the exception's text stays in the node's log: it may name paths or internals
            error = InternalError(f"internal error on node {self.node} (logged)")
            reply = envelope.encode_error_reply(request_id, error)
        if not response_topic:
            log.warning(
                "request %s on %s has no Response Topic; no reply sent", request_id, message.topic
            )
            return
        out = Properties(PacketTypes.PUBLISH)
        if correlation is not None:
            out.CorrelationData = correlation
        assert self._client is not None
        if len(reply) > _PUBLISH_WORKER_BYTES:
            # paho copies the payload into its packet as it publishes: a worker does it
            await asyncio.to_thread(
                self._client.publish, response_topic, reply, qos=1, properties=out
            )
        else:
            self._client.publish(response_topic, reply, qos=1, properties=out)
        self.replies_sent += 1

    def _publish_status(self) -> None:
        if self._client is None:
            return
        status = self.dataplane.status()
        self._client.publish(status_topic(self.node), json.dumps(status), qos=1, retain=True)

    async def _status_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.status_interval_s)
            if self._connected.is_set():
                self._publish_status()


def wait_published(info: mqtt.MQTTMessageInfo, timeout: float) -> None:
    try:
        info.wait_for_publish(timeout)
    except (RuntimeError, ValueError):
        pass
