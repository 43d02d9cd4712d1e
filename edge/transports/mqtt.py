"""MQTT v5 request/response client, as the edge agent uses it.

The socket is read on the event loop (:mod:`shared.aio.mqtt`): a reply
resolves its request's future straight from the read, with no thread hop.

Requests carry a Response Topic (``ferry/v1/replies/{client_id}``), their id
as Correlation Data and the deadline as Message Expiry.  The client also
follows the cloud nodes' retained status topics (a node's last will marks it
offline), so it knows which models some live node serves: a broker that is
up in front of dead nodes is not mistaken for a working cloud.  Pending requests
live in ``dict[correlation, Future]``; after a reconnect every unanswered
request is published again (the server may answer twice: the second answer
finds no pending entry and is dropped), so a broker restart costs latency,
not answers.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
import time
import uuid
from dataclasses import dataclass
from typing import Any

from edge.transports.base import TransferResult, as_sent
from shared import envelope
from shared.aio.mqtt import MqttClient
from shared.errors import (
    ConfigError,
    DeadlineExceeded,
    EndpointUnavailable,
    FerryError,
    InternalError,
    InvalidInput,
    ModelNotReady,
    Overloaded,
    PayloadTooLarge,
    PermissionDenied,
)
from shared.messages import InferRequest, InferResponse
from shared.mqtt import PREFIX, BrokerAddress, reply_topic, request_topic
from shared.mqtt.codec import Publish, PublishProperties, expiry_s
from shared.mqtt.documents import decode_document
from shared.mqtt.session import PacketTooLarge
from shared.mqtt.topics import silence_limit_s, status_interval_s
from shared.tensors import DEFAULT_LIMITS, Limits

NODE_STATUS_TOPICS = f"{PREFIX}/nodes/+/status"
#: times a waiting request is sent again because a node died (not a storm on churn)
_MAX_RESENDS = 3
#: Hedging (a request unanswered long past its model's usual wait goes out again, to
#: whichever member the broker deals it, while another live node hosts the model): a
#: node stalled while connected (a paused VM, a stopped process) kept its share of the
#: shared subscription until the broker dropped it, and each request dealt to it
#: waited out its deadline.  The clock runs from the broker's PUBACK (the upload is
#: done; a copy sent before it would only queue behind it on the same link): after
#: HEDGE_FACTOR x the p90 of the last HEDGE_WINDOW waits from PUBACK to reply
#: (HEDGE_MIN_SAMPLES at least, HEDGE_MIN_S at least), up to _MAX_RESENDS copies.
#: Only requests up to HEDGE_MAX_BYTES are hedged (a copy costs the uplink its size),
#: and each request earns HEDGE_RATIO hedges, HEDGE_BURST saved at most: a fleet
#: slowed by load gets at most 1.5x its requests in the long run.
HEDGE_FACTOR = 3.0
HEDGE_MIN_S = 0.1
HEDGE_WINDOW = 32
HEDGE_MIN_SAMPLES = 8
HEDGE_MAX_BYTES = 128 * 1024
HEDGE_RATIO = 0.5
HEDGE_BURST = 10.0
_NOT_AUTHORIZED = 0x87  # a PUBACK's reason: the broker's ACL refused the publish
#: a PUBACK's reason (MQTT v5, not an error): no subscription matched, so the broker
#: dropped the request and no node will ever answer it
_NO_MATCHING_SUBSCRIBERS = 0x10
#: seconds after subscribing during which no node status yet means "not known": the
#: broker sends its retained statuses right after the SUBACK
STATUS_GRACE_S = 1.0
#: cloud nodes one agent keeps track of (statuses past it drop the longest-silent one:
#: anyone who may publish a status could otherwise grow the table without end)
MAX_NODES = 4096
#: how often silent nodes are looked for (a node that died with the broker down
#: leaves no last will: its models stayed "served" for good)
SWEEP_S = 1.0
_NODES = f"{PREFIX}/nodes/"

log = logging.getLogger(__name__)


def _refusal(reason: int, topic: str) -> FerryError:
    """A broker's refusal of a publish (a PUBACK reason code, MQTT v5 3.4.2.1), typed by
    what it means for the request: Mosquitto answers one over its message_size_limit
    with 0x95 and announces no maximum, and that read as "permission denied" (and a
    deferral of it was resent every second for a day)."""
    said = f"MQTT: the broker refused the request on {topic} (reason 0x{reason:02x}"
    if reason == _NOT_AUTHORIZED:
        return PermissionDenied(f"{said}: not authorized by its ACL)")
    if reason == 0x95:
        return PayloadTooLarge(f"{said}: larger than the broker takes)")
    if reason == 0x97:
        return Overloaded(f"{said}: quota exceeded)", retry_after=1.0)
    if reason == 0x99:
        return InvalidInput(f"{said}: payload format invalid)")
    return EndpointUnavailable(f"{said})")


@dataclass
class _Pending:
    future: asyncio.Future[tuple[InferResponse, int]]
    model: str
    topic: str
    payload: bytes
    deadline: float
    resends: int = 0
    acked: asyncio.Future[Any] | None = None  # the latest copy's PUBACK
    acked_at: float | None = None  # (monotonic) when it came
    quiet: bool = False  # nobody waits on it (it only teaches): never hedged
    delivered: int = 0  # copies the broker acknowledged


class MqttTransport:
    name = "mqtt"

    def __init__(
        self,
        broker: BrokerAddress,
        *,
        client_id: str | None = None,
        tls_context: ssl.SSLContext | None = None,
        limits: Limits = DEFAULT_LIMITS,
        keepalive_s: int = 30,
    ) -> None:
        self.broker = broker
        self.client_id = client_id or f"ferry-edge-{uuid.uuid4().hex[:12]}"
        self.reply_topic = reply_topic(self.client_id, broker.username)
        self.tls_context = tls_context
        self.limits = limits
        self.keepalive_s = keepalive_s
        self._pending: dict[bytes, _Pending] = {}
        self._probes: dict[bytes, asyncio.Future[float]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: MqttClient | None = None
        self._ready = asyncio.Event()
        self.republished = 0
        self.nodes: dict[str, frozenset[str]] = {}  # live node -> models it hosts
        self._status_seen = False
        self._subscribed_at: float | None = None  # (monotonic) this session's SUBACK
        self._user_topics: dict[str, bool] = {}  # live node -> takes users' own topics
        #: live node -> (last status, silence allowed; None: it says no interval), in the
        #: order heard (the least recently heard first: the one a full table lets go)
        self._heard: dict[str, tuple[float, float | None]] = {}
        self._next_sweep = 0.0
        self._plain_only: set[str] = set()  # models whose user topic the broker refused
        self._round_trips: dict[str, collections.deque[float]] = {}  # model -> seconds
        self._hedge_tokens = HEDGE_BURST
        self.hedged = 0

    def _request_topic(self, model: str) -> str:
        """Under its broker user's own request topic when it logs in (see request_topic),
        unless the nodes serving ``model`` all predate those and take the plain one."""
        user = self.broker.username
        if not user or model in self._plain_only:
            return request_topic(model)
        hosts = [n for n, models in self.nodes.items() if model in models]
        if hosts and not any(self._user_topics.get(n) for n in hosts):
            return request_topic(model)
        return request_topic(model, user)

    def serves(self, model: str) -> bool | None:
        """Whether a live cloud node hosts ``model`` (None: not known yet).

        With no node status at all, it is unknown only just after subscribing
        (the broker's retained statuses are on their way); past that, no node
        has ever spoken on this broker, so none serves anything.  Read as
        unknown for good, a fresh broker with no node made a cloud-only model
        ready and every deferrable request wait out its deadline on it.
        """
        if not self._status_seen:
            return None if self._statuses_may_come() else False
        now = time.monotonic()
        if now >= self._next_sweep:
            self._sweep(now)
        return any(model in models for models in self.nodes.values())

    def _statuses_may_come(self) -> bool:
        at = self._subscribed_at
        return at is None or time.monotonic() - at < STATUS_GRACE_S

    @property
    def connected(self) -> bool:
        return self._ready.is_set()

    @property
    def last_error(self) -> str | None:
        """Why the broker could not be reached (a refusal's reason), None when connected."""
        return None if self._client is None or self.connected else self._client.last_error

    async def start(self, wait_s: float = 5.0) -> None:
        self._loop = asyncio.get_running_loop()
        tls = None
        if self.broker.tls:
            tls = self.tls_context or ssl.create_default_context()
        self._client = MqttClient(
            self.broker,
            self.client_id,
            tls_context=tls,
            keepalive_s=self.keepalive_s,
            # a reply is at most the body limit (the envelope around it is small)
            max_packet_bytes=self.limits.max_body_bytes + 64 * 1024,
            reconnect_min_s=0.25,
            reconnect_max_s=4.0,
            on_message=self._on_message,
            on_connect=self._on_connect,
            on_disconnect=self._on_disconnect,
        )
        await self._client.start(wait_s=0)
        try:
            await asyncio.wait_for(self._ready.wait(), wait_s)
        except TimeoutError:
            log.warning("broker %s:%s not reachable yet", self.broker.host, self.broker.port)

    async def close(self) -> None:
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(EndpointUnavailable("MQTT transport closed"))
        self._pending.clear()
        if self._client is not None:
            await self._client.close()
            self._client = None
        self._ready.clear()

    async def infer(self, model: str, request: InferRequest, deadline: float) -> TransferResult:
        if self._client is None or self._loop is None:
            raise EndpointUnavailable("MQTT transport not started")
        if not self._ready.is_set():
            raise EndpointUnavailable(
                f"not connected to broker {self.broker.host}:{self.broker.port}"
            )
        request_id = request.id or uuid.uuid4().hex
        request.id = request_id
        payload = envelope.encode_request(as_sent(request, deadline, time.monotonic()))
        if len(payload) > self.limits.max_body_bytes:
            # the cloud's limit, not the request's fault: a local run may still answer it
            raise PayloadTooLarge(
                f"request of {len(payload)} bytes exceeds the cloud's body limit "
                f"of {self.limits.max_body_bytes} bytes"
            )
        correlation = request_id.encode()
        future: asyncio.Future[tuple[InferResponse, int]] = self._loop.create_future()
        topic = self._request_topic(model)
        pending = _Pending(future, model, topic, payload, deadline)
        self._pending[correlation] = pending
        started = time.monotonic()
        self._hedge_tokens = min(HEDGE_BURST, self._hedge_tokens + HEDGE_RATIO)
        try:
            if deadline <= started:
                raise DeadlineExceeded("deadline passed before the request was sent")
            self._publish(correlation, pending)
            after = self._hedge_after(model) if len(payload) <= HEDGE_MAX_BYTES else None
            if after is None:  # nothing to hedge to: one wait, as cheap as it gets
                try:
                    await asyncio.wait_for(future, deadline - time.monotonic())
                except TimeoutError:
                    raise DeadlineExceeded(
                        f"no MQTT reply from model {model!r} within the deadline"
                    ) from None
            while not future.done():
                now = time.monotonic()
                if now >= deadline:
                    raise DeadlineExceeded(
                        f"no MQTT reply from model {model!r} within the deadline"
                    )
                wait, waiting_for = deadline - now, (future,)
                due = None
                acked = pending.acked
                if (
                    after is not None
                    and acked is not None
                    and not pending.quiet
                    and pending.resends < _MAX_RESENDS
                ):
                    if not self._ready.is_set():
                        # the broker is gone: its reconnect sends the request again
                        # (a new PUBACK, a new clock); look again shortly
                        wait = min(wait, HEDGE_MIN_S)
                    elif not acked.done():
                        waiting_for = (future, acked)  # the clock starts at the PUBACK
                    elif acked.cancelled() or acked.exception() is not None:
                        wait = min(wait, HEDGE_MIN_S)  # (this copy was lost: the same)
                    else:
                        if pending.acked_at is None:  # (its callback is a turn away)
                            pending.acked_at = now
                        due = pending.acked_at + after
                        wait = min(wait, max(due - now, 0.0))
                await asyncio.wait(waiting_for, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if future.done() or due is None:
                    continue
                if pending.acked is not acked or time.monotonic() < due:
                    continue  # sent again meanwhile (a node lost): its clock restarted
                if not self._hedge(model, correlation, pending) and self._ready.is_set():
                    after = None  # the budget is spent (or nobody waits): wait as it is
            response, received = future.result()
        finally:
            self._pending.pop(correlation, None)
            if not future.done():  # (a late PUBACK refusal must find no one to fail)
                future.cancel()
        finished = time.monotonic()
        if pending.resends == 0:  # (a resent one's wait says more of its first host)
            trips = self._round_trips.get(model)
            if trips is None:
                trips = self._round_trips[model] = collections.deque(maxlen=HEDGE_WINDOW)
            trips.append(finished - (pending.acked_at or started))
        # each copy the broker took crossed the uplink: the data cap counts it
        copies = max(1, pending.delivered)
        return TransferResult(
            response, len(payload) * copies, received, started, finished, pending.resends > 0
        )

    def stop_hedging(self, request_id: str) -> None:
        """The request's answer is no longer awaited (a race's local half answered; this
        one only teaches the estimates): it is not sent again for speed."""
        pending = self._pending.get(request_id.encode())
        if pending is not None:
            pending.quiet = True

    def _hedge_after(self, model: str) -> float | None:
        """Seconds after which an unanswered request for ``model`` is sent again; None
        where that would not help (one node hosts it, or too few round trips known)."""
        hosts = sum(1 for models in self.nodes.values() if model in models)
        trips = self._round_trips.get(model)
        if hosts < 2 or trips is None or len(trips) < HEDGE_MIN_SAMPLES:
            return None
        ordered = sorted(trips)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        return max(HEDGE_FACTOR * p90, HEDGE_MIN_S)

    def _hedge(self, model: str, correlation: bytes, pending: _Pending) -> bool:
        """Send ``pending`` again if the budget allows (False: it waits on as it is)."""
        if self._hedge_tokens < 1.0 or not self._ready.is_set():
            return False
        if pending.resends >= _MAX_RESENDS or pending.quiet:  # (a node's loss may have
            return False  # sent it again; nobody waits on a quiet one)
        self._hedge_tokens -= 1.0
        pending.resends += 1
        pending.topic = self._request_topic(model)
        try:
            self._publish(correlation, pending)
        except Overloaded:
            return False  # (the first copy is out: it is still waited for)
        except PayloadTooLarge as exc:
            pending.future.set_exception(exc)
            return False
        self.hedged += 1
        log.info("MQTT: no reply for a %s request yet: sent again (hedged)", model)
        return True

    async def probe(self, deadline: float) -> float:
        """Round trip through the broker to our own reply topic: a light RTT sample.

        It succeeds only while some cloud node is live (by the retained
        status topics), since a broker alone answers nothing.
        """
        if self._client is None or self._loop is None or not self._ready.is_set():
            raise EndpointUnavailable("MQTT transport not connected")
        if not self.nodes and (self._status_seen or not self._statuses_may_come()):
            raise EndpointUnavailable("no cloud node is online behind the broker")
        correlation = b"probe:" + uuid.uuid4().hex.encode()
        future: asyncio.Future[float] = self._loop.create_future()
        self._probes[correlation] = future
        started = time.monotonic()
        props = PublishProperties(correlation_data=correlation)
        try:
            self._client.publish(self.reply_topic, b"", properties=props)
            await asyncio.wait_for(future, max(deadline - started, 0.001))
        except TimeoutError:
            raise DeadlineExceeded("MQTT probe timed out") from None
        finally:
            self._probes.pop(correlation, None)
        return time.monotonic() - started

    def _publish(self, correlation: bytes, pending: _Pending) -> None:
        assert self._client is not None
        props = PublishProperties(
            response_topic=self.reply_topic,
            correlation_data=correlation,
            message_expiry=expiry_s(pending.deadline - time.monotonic()),
        )
        try:
            acked = self._client.publish(pending.topic, pending.payload, properties=props)
        except PacketTooLarge as exc:  # the broker's limit (its CONNACK said so)
            raise PayloadTooLarge(f"MQTT: {exc}") from None
        pending.acked, pending.acked_at = acked, None  # (a hedge's clock restarts here)
        if acked is not None:
            acked.add_done_callback(lambda done: self._puback(done, pending))

    def _puback(self, done: asyncio.Future[Any], pending: _Pending) -> None:
        """A PUBACK that refuses the request fails it now: it reached no node, and
        waiting out the deadline said nothing of why.  A refusal of the user's own
        topic (a broker whose ACL predates them) sends the model's next requests on
        the plain topic.  "No matching subscribers" fails it as not ready where no
        live node hosts the model (which says nothing against the link itself); where
        one does, it is between connections (a broker or node restart) and its return
        republishes the request (_node_status), so the request waits for it."""
        if done.cancelled() or done.exception() is not None:
            return
        if done is pending.acked:
            pending.acked_at = time.monotonic()
        reason = done.result()
        if isinstance(reason, int) and reason < 0x80:
            pending.delivered += 1
        if reason == _NO_MATCHING_SUBSCRIBERS:
            if self.serves(pending.model) is False and not pending.future.done():
                pending.future.set_exception(
                    ModelNotReady(
                        f"MQTT: no cloud node takes requests for model {pending.model!r} "
                        f"(the broker had no subscriber on {pending.topic})"
                    )
                )
            return
        if not isinstance(reason, int) or reason < 0x80:
            return
        user = self.broker.username
        if (
            reason == _NOT_AUTHORIZED
            and user
            and pending.topic == request_topic(pending.model, user)
        ):
            self._plain_only.add(pending.model)
        if not pending.future.done():
            pending.future.set_exception(_refusal(reason, pending.topic))

    # ---- broker events (on the loop, straight from the socket) ---------------------------
    def _on_connect(self) -> None:
        assert self._client is not None
        # A new session: what the nodes said before may be stale (a broker that lost
        # its state forgot their subscriptions too); their retained statuses arrive
        # again right after the SUBACK, in the same read, so forget them now (the
        # SUBACK's callback runs a loop turn later, after those statuses).
        self.nodes.clear()
        self._user_topics.clear()
        self._heard.clear()
        self._status_seen = False
        self._subscribed_at = None
        subscribed = self._client.subscribe(self.reply_topic, NODE_STATUS_TOPICS)
        subscribed.add_done_callback(self._after_subscribe)

    def _on_disconnect(self, error: Exception | None) -> None:
        self._ready.clear()

    def _on_message(self, message: Publish) -> None:
        if message.topic.startswith(_NODES):
            self._node_status(message.topic, message.payload)
            return
        correlation = message.properties.correlation_data
        if correlation is not None:
            self._resolve(correlation, message.payload)

    def _after_subscribe(self, done: asyncio.Future[Any]) -> None:
        if done.cancelled() or done.exception() is not None:
            return  # the connection dropped before the SUBACK: the next one subscribes
        was_ready = self._ready.is_set()
        self._subscribed_at = time.monotonic()
        self._ready.set()
        if not was_ready:
            self._republish(lambda pending: True)

    def _republish(self, which: Any) -> None:
        """Send again what is still waiting; the cloud's idempotency key (the request
        id) keeps a node that got both copies from running it twice."""
        now = time.monotonic()
        for correlation, pending in list(self._pending.items()):
            if not pending.future.done() and pending.deadline > now and which(pending):
                pending.resends += 1
                # the topic as the nodes serving it now take it (one that left may have
                # been the only one on users' own topics)
                pending.topic = self._request_topic(pending.model)
                try:
                    self._publish(correlation, pending)
                except (PayloadTooLarge, Overloaded) as exc:  # a smaller limit, a full queue
                    pending.future.set_exception(exc)
                    continue
                self.republished += 1

    def _node_status(self, topic: str, payload: bytes) -> None:
        node = topic.split("/")[-2]
        self._status_seen = True
        try:
            doc = decode_document(payload) or {}
            online = doc.get("state") == "online"
            models = frozenset(str(m["name"]) for m in doc.get("models", []))
            # Models placed nowhere that the nodes take requests for, to count the demand
            # that gets them placed (min_copies = 0 ones, loaded on their first use).
            models |= frozenset(str(m) for m in doc.get("catching", ()))
        except (ConfigError, ValueError, TypeError, KeyError, AttributeError):
            log.warning("unreadable status from cloud node %s", node)
            return
        now = time.monotonic()
        if online:
            arrived = node not in self.nodes
            self.nodes[node] = models
            self._user_topics[node] = doc.get("user_topics") is True
            self._heard.pop(node, None)  # (re-inserted: the dict stays in order heard)
            timed = "interval_s" in doc
            allowed = silence_limit_s(status_interval_s(doc["interval_s"])) if timed else None
            self._heard[node] = (now, allowed)
            if arrived and len(self.nodes) > MAX_NODES:
                silent = next(iter(self._heard))  # (heard least recently)
                log.warning("more than %d cloud nodes: forgetting node %s", MAX_NODES, silent)
                self._node_gone(silent)
            if arrived and self._pending:
                # A node that (re)joins may have missed what was sent while it was
                # away (a broker restarted without its sessions drops requests that
                # no subscriber took): its models' waiting requests go out again.
                self._republish(lambda pending: pending.model in models)
        else:
            self._node_gone(node)
        if now >= self._next_sweep:
            self._sweep(now)

    def _node_gone(self, node: str) -> None:
        self._user_topics.pop(node, None)
        self._heard.pop(node, None)
        if self.nodes.pop(node, None) is not None and self._pending:
            # A node that dies takes the requests in its hands with it (Mosquitto does
            # not deal a dead member's messages to another, DESIGN.md section 5): send
            # every waiting one again; the first answer wins, and the request id (the
            # cloud's idempotency key) keeps a node that had it from running it twice.
            self._republish(lambda pending: pending.resends < _MAX_RESENDS)

    def _sweep(self, now: float) -> None:
        """Nodes whose statuses stopped are gone, as the controller's fleet view has it."""
        self._next_sweep = now + SWEEP_S
        since = self._subscribed_at or 0.0  # (statuses flow again only once subscribed)
        for node, (last, allowed) in list(self._heard.items()):
            if allowed is None or now - max(last, since) <= allowed:
                continue
            log.warning("no status from cloud node %s for %.0f s: taken as gone", node, now - last)
            self._node_gone(node)

    def _resolve(self, correlation: bytes, payload: bytes) -> None:
        probe = self._probes.get(correlation)
        if probe is not None:
            if not probe.done():
                probe.set_result(time.monotonic())
            return
        pending = self._pending.get(correlation)
        if pending is None or pending.future.done():
            return  # a duplicate answer after a resend, or one that came too late
        try:
            _, result = envelope.decode_reply(payload, self.limits)
        except FerryError as exc:  # the cloud's fault, not the caller's input
            pending.future.set_exception(InternalError(f"malformed MQTT reply: {exc.message}"))
            return
        except Exception as exc:  # a malformed reply must still answer the request
            pending.future.set_exception(InternalError(f"unreadable MQTT reply: {exc!r}"))
            return
        if isinstance(result, FerryError):
            pending.future.set_exception(result)
        else:
            pending.future.set_result((result, len(payload)))
