"""Requests for a model this node does not host, sent on over the broker.

Any node answers HTTP for every placed model, so a Kubernetes Service (or any
load balancer) in front of the nodes needs no knowledge of the placement.  A
request for a model hosted elsewhere is published on the model's request
topic, where the broker's shared subscription hands it to one of the nodes
that host it, exactly like a device's request; the reply comes back on this
node's own reply topic, matched by correlation data.

Mosquitto does not re-send a dead member's in-flight messages to another
member (DESIGN.md section 5).  Inference has no side effects, so when a node
goes offline every request still waiting here is published once more; the
first reply wins and a late duplicate is ignored.  Every forwarded request
ends in exactly one answer: a result, the peer's typed error, or ours when
the deadline passes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from cloud.fleet.view import FleetView
from cloud.mqtt_front import FORWARDED, MqttFront
from shared import envelope
from shared.errors import (
    DeadlineExceeded,
    FerryError,
    InternalError,
    ModelNotReady,
    ShuttingDown,
)
from shared.messages import InferRequest, InferResponse, RequestedOutput
from shared.mqtt import reply_topic, request_topic
from shared.mqtt.codec import PublishProperties, expiry_s
from shared.pipeline.classification import requested_classes, top_k
from shared.repository import ModelConfig
from shared.tensors import Limits, Tensor

log = logging.getLogger(__name__)

#: a forwarded request with no deadline of its own waits at most this long
DEFAULT_FORWARD_TIMEOUT_S = 30.0
#: a node that reports a model loaded subscribes to its topic a moment later: a request
#: that waited for the model's new host is sent this long after the report
HOST_SETTLE_S = 0.5
#: requests above this are packed in a worker thread (msgpack copies each tensor)
_PACK_WORKER_BYTES = 1 << 20


@dataclass
class _Pending:
    model: str
    payload: bytes
    properties: PublishProperties
    future: asyncio.Future[InferResponse]
    until: float  # the request's deadline (monotonic)
    sent_at: float = field(default_factory=time.monotonic)
    resends: int = 0
    #: its node was lost and no node hosted the model then: sent again when one does
    waiting_host: bool = False


class Forwarder:
    """The dataplane's view of the rest of the fleet (:class:`cloud.dataplane.RemoteModels`)."""

    def __init__(
        self,
        front: MqttFront,
        view: FleetView,
        node: str,
        limits: Limits,
        *,
        timeout_s: float = DEFAULT_FORWARD_TIMEOUT_S,
        handover_wait_s: float = 15.0,
    ) -> None:
        self.front = front
        self.view = view
        self.node = node
        self.limits = limits
        self.timeout_s = timeout_s
        self.handover_wait_s = handover_wait_s
        self.reply_topic = reply_topic(f"{front.client_id}-fwd", front.username)
        self._pending: dict[bytes, _Pending] = {}
        self.misses: dict[str, int] = {}
        self.forwarded = 0
        self.resent = 0

    def start(self) -> None:
        self.front.add_handler(self.reply_topic, self._on_reply)

    # ---- RemoteModels --------------------------------------------------------------
    def hosted(self, name: str) -> bool:
        return bool(self.view.hosts(name, exclude=self.node))

    def placed(self, name: str) -> bool:
        placement = self.view.placement
        return placement is not None and bool(placement.copies_of(name))

    def unplaced(self, name: str) -> str | None:
        """Why the placement in force leaves ``name`` (a repository model) on no node."""
        placement = self.view.placement
        return placement.unplaced.get(name) if placement is not None else None

    def missed(self, name: str) -> None:
        """A request for a model no node hosts: the controller sees it as demand (a
        cache miss, in ModelMesh's words) and may place the model."""
        if len(self.misses) < 4096 or name in self.misses:
            self.misses[name] = self.misses.get(name, 0) + 1

    def metadata(self, name: str) -> dict[str, Any]:
        found = self.view.metadata(name)
        if found is None:
            raise ModelNotReady(f"model {name!r}: no node has described it yet", retry_after=1)
        return found

    def config(self, name: str) -> dict[str, Any]:
        found = self.view.config(name)
        if found is None:
            raise ModelNotReady(f"model {name!r}: no node has described it yet", retry_after=1)
        return found

    async def infer(
        self, name: str, request: InferRequest, *, version: str | None, deadline: float | None
    ) -> InferResponse:
        now = time.monotonic()
        until = deadline if deadline is not None else now + self.timeout_s
        if until <= now:
            raise DeadlineExceeded(f"deadline passed before model {name!r} was forwarded")
        # The MQTT envelope names outputs only: Triton's classification parameters are
        # applied here, on the raw outputs the hosting node sends back.
        classes = requested_classes(ModelConfig(name), request)
        config = self.view.config(name) if classes else None
        if classes and config is None:  # (guessed unbatched, a batch of 2 came back 1 row)
            raise ModelNotReady(
                f"model {name!r}: no node has described it yet, so its classification "
                "cannot be read here",
                retry_after=1.0,
            )
        original_id = request.id
        request = InferRequest(
            id=request.id or uuid.uuid4().hex,
            inputs=request.inputs,
            outputs=(
                None
                if request.outputs is None
                else [RequestedOutput(o.name) for o in request.outputs]
            ),
            parameters=request.parameters,
            model_version=version or request.model_version,
        )
        size = sum(t.data.nbytes for t in request.inputs)
        if size > _PACK_WORKER_BYTES:
            payload = await asyncio.to_thread(envelope.encode_request, request)
        else:
            payload = envelope.encode_request(request)
        correlation = uuid.uuid4().bytes
        props = PublishProperties(
            response_topic=self.reply_topic,
            correlation_data=correlation,
            message_expiry=expiry_s(until - now),
            user_properties=[(FORWARDED, self.node)],
        )
        future: asyncio.Future[InferResponse] = asyncio.get_running_loop().create_future()
        self._pending[correlation] = _Pending(name, payload, props, future, until)
        self.forwarded += 1
        try:
            self.front.publish(request_topic(name, self.front.username), payload, properties=props)
            response = await asyncio.wait_for(future, max(0.0, until - time.monotonic()))
        except TimeoutError:
            raise DeadlineExceeded(
                f"model {name!r}: no answer from the fleet before the deadline"
            ) from None
        finally:
            self._pending.pop(correlation, None)
        response.id = original_id
        if classes:
            batched = bool((config or {}).get("max_batch_size"))
            response.outputs = [
                Tensor(t.name, "BYTES", top_k(t.data, classes[t.name], batched))
                if t.name in classes
                else t
                for t in response.outputs
            ]
        return response

    # ---- replies and failures ------------------------------------------------------------
    def _on_reply(self, topic: str, payload: bytes | None, properties: PublishProperties) -> None:
        correlation = properties.correlation_data
        pending = self._pending.get(correlation) if correlation else None
        if pending is None or pending.future.done():
            return  # late duplicate, or the caller gave up
        if payload is None:  # the host answered; this node cannot take that much back
            pending.future.set_exception(
                InternalError(
                    f"the answer from the node hosting {pending.model!r} is over this "
                    f"node's body limit of {self.limits.max_body_bytes} bytes ([limits] "
                    "max_body_bytes): ask for fewer items, or raise the limit"
                )
            )
            return
        try:
            _, result = envelope.decode_reply(payload, self.limits)
        except FerryError as exc:
            pending.future.set_exception(exc)
            return
        others = self.view.hosts(pending.model, exclude=self.node)
        if isinstance(result, ShuttingDown) and pending.resends < 3 and len(others) > 1:
            # its host is draining (it took this before its intake stopped): another
            # host answers it, a moment on, once the broker has the drain's unsubscribe
            # (passed back, the client got a 503 through a node that was not stopping);
            # with no other host the 503 goes back at once (not a wait for a new one)
            log.info("a forwarded %s request met a node shutting down: resending", pending.model)
            asyncio.get_running_loop().call_later(
                HOST_SETTLE_S, self._send_to_new_host, correlation
            )
            return
        if isinstance(result, FerryError):
            pending.future.set_exception(result)
        else:
            pending.future.set_result(result)

    def node_lost(self, node: str) -> None:
        """A node went offline: publish every waiting request again (it may have been
        the one holding it; a duplicate answer is dropped).

        Where no node hosts the model any more (the lost one was its only home),
        a message now would find no subscriber and the broker would drop it: the
        request waits for the model's new host (:meth:`hosts_changed`) instead.
        """
        for pending in list(self._pending.values()):
            if pending.future.done() or pending.resends >= 3:
                continue
            if self._has_host(pending.model):
                log.info("node %s lost: resending a forwarded %s request", node, pending.model)
                self._resend(pending)
            elif not pending.waiting_host:
                pending.waiting_host = True
                log.info(
                    "node %s lost: a forwarded %s request waits for the model's new host",
                    node,
                    pending.model,
                )

    def hosts_changed(self) -> None:
        """A node reported its models, or this one loaded one: send each request that
        waits for a host there, once, half a second on (a node reports a model as
        loaded a moment before its subscription to the model's topic is in place)."""
        loop = asyncio.get_running_loop()
        for correlation, pending in list(self._pending.items()):
            if not pending.waiting_host or pending.future.done():
                continue
            if not self._has_host(pending.model):
                continue
            pending.waiting_host = False
            loop.call_later(HOST_SETTLE_S, self._send_to_new_host, correlation)

    def _send_to_new_host(self, correlation: bytes) -> None:
        pending = self._pending.get(correlation)
        if pending is not None and not pending.future.done():
            log.info("resending a forwarded %s request to its new host", pending.model)
            self._resend(pending)

    def _has_host(self, model: str) -> bool:
        return bool(self.view.hosts(model, exclude=self.node)) or self.front.serves(model)

    def _resend(self, pending: _Pending) -> None:
        """Publish ``pending`` again, its expiry what is left of its deadline."""
        left = pending.until - time.monotonic()
        if left <= 0:
            return  # its caller answers it with the deadline error
        pending.resends += 1
        self.resent += 1
        old = pending.properties
        props = PublishProperties(
            response_topic=old.response_topic,
            correlation_data=old.correlation_data,
            message_expiry=expiry_s(left),
            user_properties=old.user_properties,
        )
        topic = request_topic(pending.model, self.front.username)
        try:
            self.front.publish(topic, pending.payload, properties=props)
        except FerryError as exc:  # (the broker takes nothing now: this one fails alone)
            if not pending.future.done():
                pending.future.set_exception(exc)

    def fail_all(self, error: FerryError) -> None:
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(error)
