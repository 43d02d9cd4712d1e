"""The cloud node's MQTT v5 front: shared subscriptions in, replies out.

The MQTT client (:mod:`shared.aio.mqtt`) reads the broker's socket on the
event loop and hands each message to :meth:`MqttFront._on_message` there, so
a request costs no thread hop on its way in or out.  Each is answered on its
Response Topic with its Correlation Data; Message Expiry becomes the
request's deadline.  The client reconnects by itself and ``_after_connect``
re-subscribes, so a broker restart needs nothing from the operator.

Backpressure: at most ``max_inflight`` requests, and at most the node's byte
budget (shared with the HTTP front), may be received and not yet answered.
Both are checked before a request is decoded, so a flood costs one
"overloaded" error reply per message (with ``retry_after_ms``) instead of
unbounded memory; a message longer than the body limit is never held whole
(the client keeps its head) and is answered "payload too large".

Invariants: only the event loop touches this object; every received request
gets exactly one reply (a result or a typed error), also while the node
shuts down ("unavailable").
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from cloud.config import MqttConfig
from cloud.dataplane import DataPlane
from shared import envelope
from shared.admission import ByteBudget
from shared.aio.http_server import CUT_ANSWER_S
from shared.aio.mqtt import MqttClient
from shared.errors import (
    FerryError,
    InternalError,
    InvalidInput,
    Overloaded,
    PayloadTooLarge,
    ShuttingDown,
)
from shared.mqtt import (
    PREFIX,
    REPLIES,
    BrokerAddress,
    model_from_topic,
    parse_request_topic,
    reply_principal,
    shared_request_topic,
    shared_request_topics,
    status_topic,
)
from shared.mqtt.codec import (
    Publish,
    PublishProperties,
    Will,
    topic_matches,
    topic_name_problem,
)
from shared.mqtt.session import PacketTooLarge
from shared.recurring import Recurring
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
    **options: Any,
) -> MqttClient:
    """An MQTT v5 client for the cloud tier (node, controller, ``fleet``) with the
    broker's credentials and TLS; ``options`` go to :class:`MqttClient`."""
    tls = (
        client_tls_context(
            ca_file, insecure=insecure, cert_file=cert_file, key_file=key_file, section="mqtt"
        )
        if broker.tls
        else None
    )
    return MqttClient(broker, client_id, tls_context=tls, **options)


def offline_will(node: str) -> Will:
    return Will(status_topic(node), json.dumps({"node": node, "state": "offline"}).encode())


#: user property a node puts on a request it forwards (such a request is not forwarded again)
FORWARDED = "ferry-forwarded-by"
_REQUEST_HEAD = f"{PREFIX}/models/"
#: answers held across a broken connection to the broker: how many, how many bytes, how long
HELD_REPLIES = 1024
HELD_REPLY_BYTES = 64 << 20
HELD_REPLY_S = 60.0
#: a burst of model changes is published as one status, this long after the first
STATUS_COALESCE_S = 0.2
#: what a status too big for the broker leaves out, in this order
_TRIMMED = ("metadata", "configs")
#: Retry-After hint for a refused MQTT request when the model's own queue gives none
_DEFAULT_RETRY_S = 0.1
#: requests not served for their Response Topic that are logged a minute, at most
UNSERVED_LOGS = 10


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
        self.budget = budget or ByteBudget(0)
        self._client: MqttClient | None = None
        self._subscribed: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._cut = False  # the drain's grace ran out: requests still running answer so
        self._status_task: asyncio.Task[None] | None = None
        self._status_soon: asyncio.Handle | None = None  # a coalesced status, due
        self._status_at = -math.inf  # (loop time) when a change's status last went out
        self._status_trim = 0  # how many of _TRIMMED the status leaves out (too big)
        self._status_trouble = Recurring(log, f"node {node}'s status")
        self._accepting = True  # False once intake stopped: late requests get "unavailable"
        self._closed = False
        #: topic filter -> callable(topic, payload, properties) run on the loop (fleet
        #: messages: placement, node status, forwarded replies)
        self._handlers: dict[str, Any] = {}
        self._connect_listeners: list[Any] = []
        #: loaded models whose request topic is withheld (being moved away)
        self._withheld: set[str] = set()
        self._per_model: dict[str, int] = {}  # requests being handled, per model
        #: models placed on no node whose requests this node takes too (the placement
        #: follower sets it): answered "not ready" and counted as misses, which get the
        #: model placed.  Every node takes them in the one share group, so each request
        #: reaches one node; with no subscriber the broker had dropped them unseen.
        self.catching: Callable[[], Iterable[str]] = tuple
        self._caught: set[str] = set()
        self.inflight = 0  # requests received and not yet answered
        self.received = 0  # requests the broker delivered
        self.replies_sent = 0
        self.refused = 0
        self.bad_reply_topics = 0  # requests not served for their Response Topic (or none)
        self._unserved_window, self._unserved_logged = -math.inf, 0
        self.refused_replies = 0  # answers the broker refused (its ACL, its size limit)
        self.resent_replies = 0  # answers sent again after the connection to the broker broke
        self.dropped_replies = 0  # answers whose resend lost the connection again
        # answers the broker's connection cannot take now: said once, then once a minute
        self._unsent = Recurring(log, f"node {node}'s MQTT replies")
        #: answers whose connection ended before the broker took them: sent again on the
        #: next one (at least once: an agent takes the first answer of a request only)
        self._held: collections.deque[tuple[float, str, bytes, PublishProperties]] = (
            collections.deque()
        )
        self._held_bytes = 0
        self._refusal_logged = -math.inf
        self._status_refusal_logged = -math.inf

    # ---- lifecycle --------------------------------------------------------------
    async def start(self, wait_s: float = 5.0) -> None:
        broker = self.config.broker
        self._client = new_client(
            broker,
            self.client_id,
            ca_file=self.config.ca_file,
            insecure=self.config.tls_insecure,
            cert_file=self.config.cert_file,
            key_file=self.config.key_file,
            keepalive_s=self.config.keepalive_s,
            will=offline_will(self.node),
            # a request over the body limit is answered from its head, never held whole
            max_packet_bytes=self.limits.max_body_bytes + 64 * 1024,
            reconnect_min_s=0.5,
            on_message=self._on_message,
            on_connect=self._after_connect,
            on_disconnect=self._on_disconnect,
        )
        self.dataplane.on_models_changed.append(self._models_changed)
        if not await self._client.start(wait_s):
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
        if client is not None and client.connected and self._subscribed:
            client.unsubscribe(*sorted(self._subscribed))
        self._subscribed.clear()

    async def drain(self, deadline: float) -> None:
        """Wait (until the monotonic ``deadline``) for every request received so far,
        including those that arrived after intake stopped."""
        while self._tasks:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                # The grace is over: each request still running is answered that the node
                # stops (it was acknowledged on receipt: the broker will not send it again,
                # and its sender had waited out its own deadline for nothing).
                log.warning(
                    "MQTT drain: %d requests still running at the deadline: answered shutting_down",
                    len(self._tasks),
                )
                self._cut = True
                tasks = list(self._tasks)
                for task in tasks:
                    task.cancel()
                await asyncio.wait(tasks, timeout=CUT_ANSWER_S)
                return
            await asyncio.wait(list(self._tasks), timeout=remaining)
            await asyncio.sleep(0)  # let messages already received spawn their tasks

    async def close(self, timeout_s: float = 2.0) -> None:
        """Publish the offline status (waiting at most ``timeout_s``) and leave the broker."""
        self._closed = True
        if self._status_task is not None:
            self._status_task.cancel()
        if self._status_soon is not None:
            self._status_soon.cancel()
            self._status_soon = None
        client = self._client
        if client is not None:
            offline = json.dumps({"node": self.node, "state": "offline"}).encode()
            try:
                acked = client.publish(status_topic(self.node), offline, retain=True)
            except FerryError:  # (its last will says it instead; the client still closes)
                acked = None
            if acked is not None:
                try:
                    await asyncio.wait_for(acked, timeout_s)
                except (TimeoutError, FerryError):
                    pass
            await client.close()

    async def stop(self, grace_s: float = 30.0) -> None:
        """Stop taking requests, answer those in flight, then leave the broker."""
        self.stop_intake()
        await self.drain(time.monotonic() + grace_s)
        await self.close()

    @property
    def connected(self) -> bool:
        return self._client is not None and self._client.connected

    def _on_disconnect(self, error: Exception | None) -> None:
        if self._accepting:
            log.warning("MQTT disconnected (%s); reconnecting", error or "broker closed")

    # ---- intake (on the loop, straight from the socket) -------------------------------
    def _on_message(self, message: Publish) -> None:
        received = time.monotonic()
        if self._closed:
            return
        if not message.topic.startswith(_REQUEST_HEAD):
            self._route(message)
            return
        self.received += 1
        if message.truncated:
            self._refuse(
                message,
                PayloadTooLarge(
                    f"request of {message.truncated} bytes exceeds the limit of "
                    f"{self.limits.max_body_bytes}"
                ),
            )
            return
        if self.max_inflight and self.inflight >= self.max_inflight:
            model = model_from_topic(message.topic)
            hint = self.dataplane.retry_hint(model) or _DEFAULT_RETRY_S
            self._refuse(
                message,
                Overloaded(
                    f"node {self.node}: {self.max_inflight} MQTT requests in flight",
                    retry_after=hint,
                ),
            )
            return
        size = len(message.payload)
        if not self.budget.try_take(size):
            self._refuse(message, self.budget.overloaded(size))
            return
        self.inflight += 1
        task = asyncio.create_task(self._handle(message, received))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._task_done(t, size))

    def _route(self, message: Publish) -> None:
        """A fleet message: hand it to the handler of the first filter that matches
        (its payload None when it was over the body limit: only its head was kept)."""
        payload = None if message.truncated else message.payload
        for pattern, handler in list(self._handlers.items()):
            if topic_matches(pattern, message.topic):
                try:
                    handler(message.topic, payload, message.properties)
                except Exception:
                    log.exception("fleet handler for %s failed", message.topic)
                return

    def _refuse(self, message: Publish, error: FerryError) -> None:
        """Answer without decoding the tensors."""
        self.refused += 1
        if not message.properties.response_topic and not message.truncated:
            # an MQTT 3.1.1 client's reply topic, as _answer reads it (an overloaded
            # node had left such a client waiting out its own timeout)
            topic = envelope.peek_reply_topic(message.payload)
            if topic:
                message.properties = message.properties.replaced(response_topic=topic)
        props = message.properties
        if not self._replyable(message):
            return
        request_id = envelope.peek_request_id(message.payload) or ""
        self._reply(props, envelope.encode_error_reply(request_id, error))

    def _replyable(self, message: Publish) -> bool:
        """Whether a reply can go to the request's Response Topic (logged when not).

        Only into the replies tree, and on a user's own request topic only into
        that user's subtree: the node may write any reply topic, so without these
        a requester could aim replies at a node's status topic (blanking its models
        in the fleet view), at request topics, or into another device's replies,
        matched to its pending requests.
        """
        topic = message.properties.response_topic
        if not topic:
            return False
        parsed = parse_request_topic(message.topic)
        sender = parsed[1] if parsed is not None else None
        home = f"{REPLIES}{sender}/" if sender else REPLIES
        if not topic.startswith(home):
            self.bad_reply_topics += 1
            self._unserved(
                "request on %s names Response Topic %r, outside %s#: not served, no reply",
                message.topic,
                topic[:200],
                home,
            )
            return False
        problem = topic_name_problem(topic)
        if problem is not None:
            self.bad_reply_topics += 1
            self._unserved(
                "request on %s names Response Topic %r, which %s: not served, no reply "
                "(a PUBLISH there would get this node disconnected)",
                message.topic,
                topic[:200],
                problem.removeprefix("it "),
            )
            return False
        return True

    def _unserved(self, message: str, *args: object) -> None:
        """Log a request not served for its Response Topic, ``UNSERVED_LOGS`` a minute at
        most (past that they are counted in ``bad_reply_topics``): a client sending
        such requests in a loop would otherwise flood the node's log."""
        now = time.monotonic()
        if now - self._unserved_window >= 60.0:
            if self._unserved_logged > UNSERVED_LOGS:
                log.warning(
                    "%d more requests not served for their Response Topic in the last minute",
                    self._unserved_logged - UNSERVED_LOGS,
                )
            self._unserved_window, self._unserved_logged = now, 0
        self._unserved_logged += 1
        if self._unserved_logged <= UNSERVED_LOGS:
            log.warning(message, *args)
        elif self._unserved_logged == UNSERVED_LOGS + 1:
            log.warning("more requests not served for their Response Topic: counted, not logged")

    def _reply(self, props: PublishProperties, payload: bytes) -> None:
        if self._client is not None and props.response_topic:
            out = PublishProperties(correlation_data=props.correlation_data)
            self._send_reply(props.response_topic, payload, out, error=False)

    def _send_reply(
        self,
        topic: str,
        payload: bytes,
        props: PublishProperties,
        *,
        error: bool,
        since: float | None = None,
    ) -> None:
        """Publish an answer and hear how the broker took it: a refusal is logged and,
        for its size, answered with a short error; a connection that ends first holds
        it for the next (an answer had been lost without a trace either way), once: one
        whose resend ends the connection again is dropped (a poisoned answer the broker
        cuts the node off for had been resent at every reconnect for a minute).
        ``since``: when it was first held (a resend keeps its age)."""
        client = self._client
        if client is None:
            return
        at = time.monotonic() if since is None else since
        if not client.connected:
            self._hold(at, topic, payload, props)
            return

        def acked(outcome: Any) -> None:
            if isinstance(outcome, BaseException):
                if since is None:
                    self._hold(at, topic, payload, props)
                else:
                    self.dropped_replies += 1
                    log.warning(
                        "an answer on %s dropped: the connection ended again as it was sent again",
                        topic[:200],
                    )
            elif outcome >= 0x80:
                self._refused_reply(topic, payload, props, outcome, error)

        try:
            client.publish(topic, payload, properties=props, on_ack=acked)
            if self._unsent.failing:
                self._unsent.ok("go out again")
        except Overloaded as exc:  # the broker takes nothing (its queue, or ours, is full)
            if client.stalled:  # (dropped within 1.5 keepalives: held ones go out again)
                self._hold(at, topic, payload, props)
                self._unsent.failed(f"answers wait for the next connection: {exc.message}")
            else:  # (a full window on a live connection: a reconnect would not clear it)
                self.dropped_replies += 1
                self._unsent.failed(f"answers are dropped: {exc.message}")
            return
        except PacketTooLarge as exc:  # over the broker's maximum packet size
            log.warning("an answer on %s not sent: %s", topic[:200], exc)
            if not error:  # the requester still gets an answer: a short error
                request_id = envelope.peek_request_id(payload) or ""  # (a reply has it too)
                failure = InternalError(
                    f"node {self.node}: the answer ({len(payload)} bytes) is over the "
                    "broker's maximum packet size: ask for fewer items"
                )
                reply = envelope.encode_error_reply(request_id, failure)
                self._send_reply(topic, reply, props, error=True, since=since)

    def _refused_reply(
        self, topic: str, payload: bytes, props: PublishProperties, reason: int, error: bool
    ) -> None:
        self.refused_replies += 1
        why = {
            0x87: "not authorized (the broker's ACL: a node writes ferry/v1/replies/#)",
            0x95: "over the broker's message size limit (message_size_limit)",
            0x97: "over the broker's quota",
        }.get(reason, "refused")
        now = time.monotonic()
        if now - self._refusal_logged >= 10.0:  # (a refusing broker refuses them all)
            self._refusal_logged = now
            log.warning(
                "the broker refused an answer on %s (%d bytes): reason 0x%02x, %s",
                topic[:200],
                len(payload),
                reason,
                why,
            )
        if reason in (0x95, 0x97) and not error:
            request_id = envelope.peek_request_id(payload) or ""  # (a reply has the id too)
            failure: FerryError = (
                PayloadTooLarge(
                    f"node {self.node}: the broker refused the answer ({len(payload)} "
                    f"bytes): {why}; ask for fewer items"
                )
                if reason == 0x95
                else Overloaded(
                    f"node {self.node}: the broker refused the answer: {why}", retry_after=1.0
                )
            )
            reply = envelope.encode_error_reply(request_id, failure)
            self._send_reply(topic, reply, props, error=True)

    def _hold(self, at: float, topic: str, payload: bytes, props: PublishProperties) -> None:
        if self._client is None or len(payload) > HELD_REPLY_BYTES:
            return  # (one too big to hold must not empty the queue of the others)
        held = self._held
        while held and (
            len(held) >= HELD_REPLIES or self._held_bytes + len(payload) > HELD_REPLY_BYTES
        ):
            self._held_bytes -= len(held.popleft()[2])
        held.append((at, topic, payload, props))
        self._held_bytes += len(payload)

    def _resend_held(self) -> None:
        held, self._held, self._held_bytes = self._held, collections.deque(), 0
        stale = time.monotonic() - HELD_REPLY_S
        for at, topic, payload, props in held:
            if at >= stale:  # (older ones: their requesters' deadlines have passed)
                self.resent_replies += 1
                try:
                    self._send_reply(topic, payload, props, error=False, since=at)
                except Exception:  # (never at the cost of the subscriptions after it)
                    log.exception("a held answer on %s not sent again", topic[:200])

    # ---- on the event loop ----------------------------------------------------------
    def _after_connect(self) -> None:
        self._subscribed.clear()  # a new connection starts with no subscriptions
        if self._handlers:
            self._client.subscribe(*sorted(self._handlers))  # type: ignore[union-attr]
        self._sync_subscriptions()
        self._publish_status()
        self._resend_held()  # (last: a failure here must not cost the subscriptions)
        for listener in self._connect_listeners:
            listener()

    def on_connected(self, listener: Any) -> None:
        """Call ``listener()`` on the loop after every (re)connect (the fleet view times
        nodes' silence from then: nothing is heard while the broker is away)."""
        self._connect_listeners.append(listener)

    # ---- fleet hooks (the placement follower and the forwarder) -----------------------
    def add_handler(self, pattern: str, handler: Any) -> None:
        """Deliver messages on ``pattern`` to ``handler(topic, payload, properties)`` on
        the loop; subscribed now and after every reconnect.  ``payload`` is None for a
        message over ``max_body_bytes`` (never held whole)."""
        self._handlers[pattern] = handler
        if self.connected:
            self._client.subscribe(pattern)  # type: ignore[union-attr]

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        retain: bool = False,
        properties: PublishProperties | None = None,
    ) -> asyncio.Future[Any] | None:
        """QoS 1; None when the broker is not connected (the message is dropped)."""
        if self._client is None:
            return None
        return self._client.publish(topic, payload, retain=retain, properties=properties)

    @property
    def username(self) -> str | None:
        return self.config.broker.username

    def serves(self, name: str) -> bool:
        """Whether this node takes ``name``'s requests from the broker now to serve them
        (not only to count them: see :attr:`catching`)."""
        return name not in self._caught and shared_request_topic(name) in self._subscribed

    def publish_status(self) -> None:
        """Publish the node's status now (after a placement step, say)."""
        if self.connected:
            self._publish_status()

    async def withhold(self, name: str, timeout_s: float = 5.0) -> None:
        """Stop taking ``name``'s requests from the broker: unsubscribe its shared topic
        and wait for the broker's acknowledgement (after it, no new request for it
        reaches this node), then for the requests already received to finish."""
        self._withheld.add(name)
        topics = [t for t in shared_request_topics(name) if t in self._subscribed]
        client = self._client
        if client is not None and topics:
            self._subscribed.difference_update(topics)
            if client.connected:
                try:
                    await asyncio.wait_for(client.unsubscribe(*topics), timeout_s)
                except TimeoutError:
                    log.warning("no UNSUBACK for %s within %.1f s", topics, timeout_s)
                except FerryError:
                    pass  # the connection dropped: the subscription went with it
        deadline = time.monotonic() + timeout_s
        while self._per_model.get(name, 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def release(self, name: str) -> None:
        """Take ``name``'s requests again once it is loaded (undoes :meth:`withhold`)."""
        self._withheld.discard(name)
        if self.connected:
            self._sync_subscriptions()

    @property
    def caught(self) -> list[str]:
        """The models this node takes requests for only to count them (see :attr:`catching`)."""
        return sorted(self._caught)

    def resync(self) -> None:
        """What this node may catch changed (see :attr:`catching`): subscribe, and say
        so when what it catches did (only then: a status resets its utilisation window,
        and every node hears every other's)."""
        before = set(self._caught)
        if self.connected:
            self._sync_subscriptions()
            if self._caught != before:
                self._publish_status()

    def _models_changed(self) -> None:
        if self.connected:
            self._sync_subscriptions()
            # The first change at once; those after it within STATUS_COALESCE_S in one
            # status at its end: a node converging onto 1,000 models had published its
            # whole (growing) status at every load, 400 MB.
            if self._status_soon is not None:
                return  # (one is due: it carries this change too)
            loop = asyncio.get_running_loop()
            wait = self._status_at + STATUS_COALESCE_S - loop.time()
            if wait <= 0:
                self._status_now()
            else:
                self._status_soon = loop.call_later(wait, self._status_now)

    def _status_now(self) -> None:
        self._status_soon = None
        if self.connected and not self._closed:
            self._status_at = asyncio.get_running_loop().time()
            self._publish_status()

    def _sync_subscriptions(self) -> None:
        client = self._client
        if client is None or not self._accepting or not client.connected:
            return
        loaded = self.dataplane.loaded_names()
        self._caught = {n for n in self.catching() if n not in loaded}
        wanted = {
            topic
            for name in [*loaded, *self._caught]
            if name not in self._withheld
            for topic in shared_request_topics(name)
        }
        added = sorted(wanted - self._subscribed)
        if added:
            client.subscribe(*added)
        dropped = sorted(self._subscribed - wanted)
        if dropped:
            client.unsubscribe(*dropped)
        self._subscribed = wanted

    def _task_done(self, task: asyncio.Task[None], size: int) -> None:
        self._tasks.discard(task)
        self.budget.give(size)
        self.inflight -= 1
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("request handling failed: %r", exc, exc_info=exc)

    async def _handle(self, message: Publish, received: float) -> None:
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

    async def _answer(self, message: Publish, received: float, model: str | None) -> None:
        props = message.properties
        response_topic = props.response_topic
        if not response_topic:
            if not message.payload:
                return  # (a retained request cleared: nothing is asked, nobody to answer)
            # MQTT 3.1.1 has no Response Topic: such a client names its reply topic in
            # the envelope's parameters (the same rules apply), and matches the answer
            # by the envelope's id
            response_topic = envelope.peek_reply_topic(message.payload)
            # (this message's own properties: never the shared empty instance's, which
            # had sent every later 3.1.1 client's reply, and every status, to the first
            # client's topic)
            message.properties = props = props.replaced(response_topic=response_topic)
        if not response_topic:
            self.bad_reply_topics += 1
            self._unserved(
                "request on %s has no Response Topic (MQTT v5), nor a 'reply_topic' "
                "parameter (MQTT 3.1.1): not served, no reply",
                message.topic,
            )
            return
        if not self._replyable(message):
            return
        expiry = props.message_expiry
        deadline = received + expiry if expiry else None
        payload = message.payload
        request_id = None
        try:
            if not self._accepting:
                raise ShuttingDown(f"node {self.node} is shutting down")
            if model is None:
                raise InvalidInput(f"not a request topic: {message.topic!r}")
            forwarded = props.user_property(FORWARDED) is not None
            if not forwarded:  # an unknown model is refused before decoding
                self.dataplane.check_servable(model, None)
            if envelope.decode_needs_worker(payload):  # big or BYTES: off the loop
                request = await asyncio.to_thread(envelope.decode_request, payload, self.limits)
            else:
                request = envelope.decode_request(payload, self.limits)
            request_id = request.id
            # Who sent it: the user whose own request topic it came on (a locked broker
            # lets only that user publish there), else the user the reply topic names.
            parsed = parse_request_topic(message.topic)
            sender = parsed[1] if parsed is not None else None
            response = await self.dataplane.infer(
                model,
                request,
                deadline=deadline,
                principal=sender or reply_principal(response_topic),
                forwardable=not forwarded,
            )
            if envelope.encode_needs_worker(response):
                reply = await asyncio.to_thread(envelope.encode_reply, response)
            else:
                reply = envelope.encode_reply(response)
        except FerryError as exc:
            request_id = request_id or envelope.peek_request_id(payload) or ""
            reply = envelope.encode_error_reply(request_id, exc)
        except asyncio.CancelledError:
            if not self._cut:
                raise
            request_id = request_id or envelope.peek_request_id(payload) or ""
            stopped = ShuttingDown(
                f"node {self.node} stopped before this request's answer (its shutdown grace "
                "ran out): send it again"
            )
            self._reply(props, envelope.encode_error_reply(request_id, stopped))
            self.replies_sent += 1
            raise
        except Exception:  # never let one message take the front down
            log.exception("MQTT request failed")
            request_id = request_id or envelope.peek_request_id(payload) or ""
            # the exception's text stays in the node's log: it may name paths or internals
            error = InternalError(f"internal error on node {self.node} (logged)")
            reply = envelope.encode_error_reply(request_id, error)
        self._reply(props, reply)  # (one over the broker's packet size: a short error)
        self.replies_sent += 1

    def _publish_status(self) -> None:
        if self._client is None:
            return
        doc = self.dataplane.status()
        # (it takes requests on each user's own topic too: an agent logged in to the
        # broker uses that only when a node serving the model says so, see request_topic)
        doc["user_topics"] = True
        doc["unserved_requests"] = self.bad_reply_topics  # (no Response Topic one may use)
        doc["refused_answers"] = self.refused_replies  # (the broker's ACL or size limit)
        doc["interval_s"] = self.config.status_interval_s  # (silent for 3 of these: gone)
        # Over the broker's packet or message size (the hosted models' metadata, ~780 B
        # each, then their configs): sent without them, so the node stays in the fleet
        # (a controller had taken it for dead, and every model load failed on the
        # publish).  Other nodes keep the descriptions they had of it.
        for key in _TRIMMED[: self._status_trim]:
            doc.pop(key, None)
        payload = json.dumps(doc).encode()
        try:
            self._client.publish(
                status_topic(self.node), payload, retain=True, on_ack=self._status_acked
            )
        except PacketTooLarge as exc:
            self._status_too_big(f"{exc}")
        except FerryError as exc:  # (the broker takes nothing now: the next one goes
            # later; raised from here, a load or unload had left its old sessions behind)
            self._status_trouble.failed(f"it is not sent: {exc.message}")
        else:
            if self._status_trouble.failing:
                self._status_trouble.ok("is sent again")

    def _status_too_big(self, why: str) -> None:
        """The status is over what the broker takes: the next leaves out more, now."""
        if self._status_trim >= len(_TRIMMED):
            self._status_trouble.failed(f"it is not sent even without {_TRIMMED}: {why}")
            return
        self._status_trim += 1
        left_out = ", ".join(_TRIMMED[: self._status_trim])
        self._status_trouble.failed(
            f"it is over the broker's size limit ({why}): sent without {left_out}"
        )
        if self._status_soon is None and not self._closed:
            self._status_soon = asyncio.get_running_loop().call_soon(self._status_now)

    def _status_acked(self, outcome: Any) -> None:
        """A status the broker refuses leaves the node invisible to the fleet: said."""
        if isinstance(outcome, BaseException) or outcome < 0x80:
            return
        if outcome == 0x95:  # over Mosquitto's message_size_limit (no CONNACK says it)
            self._status_too_big("PUBACK 0x95: packet too large")
            return
        now = time.monotonic()
        if now - self._status_refusal_logged >= 60.0:
            self._status_refusal_logged = now
            log.error(
                "the broker refused this node's status on %s (reason 0x%02x): the fleet and "
                "the agents cannot see node %r (on a locked broker a node's name must be its "
                "user name)",
                status_topic(self.node),
                outcome,
                self.node,
            )

    async def _status_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.status_interval_s)
            if self.connected:
                try:
                    self._publish_status()
                except Exception:  # one bad status must not end the heartbeat for good:
                    # three intervals later the fleet would count a serving node as gone
                    log.exception("node status not published")
