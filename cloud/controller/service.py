"""``ferry-cloud controller``: the thin async shell around :class:`ControllerCore`.

It reads the nodes' retained statuses and the retained placement from the
broker, steps the core twice a second, and publishes what the core decides:

- ``ferry/v1/placement`` (retained, QoS 1): the placement, JSON (documented in
  docs/scale-out.md);
- ``ferry/v1/fleet/alerts`` (retained): the utilisation alerts in force;
- ``ferry/v1/controller/status`` (retained; its last will says "offline").

An HTTP endpoint serves ``/metrics`` (Prometheus: copies per model, memory
per node, moves, nodes used against the lower bound, utilisation, alerts),
``/fleet`` (the same as JSON) and ``/v2/health/live``.

Nothing the nodes do depends on this process being alive: the placement is
retained, nodes keep serving it, and a restarted controller converges on the
same placement without moving models (see :mod:`cloud.controller.core`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from dataclasses import dataclass

from cloud.controller.core import ControllerCore
from cloud.controller.metrics import render_controller_metrics
from cloud.fleet.follower import STATUS_PATTERN
from cloud.fleet.view import decode_document
from cloud.mqtt_front import new_client
from shared.aio.http_server import HttpServer, Request, Response, RoutedApp, Router, json_response
from shared.aio.mqtt import MqttClient
from shared.errors import ConfigError, FerryError
from shared.mqtt import PLACEMENT_TOPIC, PREFIX, BrokerAddress, node_from_status_topic
from shared.mqtt.codec import Publish, Will

log = logging.getLogger(__name__)

ALERTS_TOPIC = f"{PREFIX}/fleet/alerts"
CONTROLLER_TOPIC = f"{PREFIX}/controller/status"
STEP_S = 0.5


@dataclass(frozen=True)
class ControllerOptions:
    broker: BrokerAddress
    client_id: str = "ferry-controller"
    http_host: str = "127.0.0.1"
    http_port: int | None = 8001  # None: no HTTP endpoint


class ControllerService(RoutedApp):
    def __init__(self, core: ControllerCore, options: ControllerOptions) -> None:
        self.core = core
        self.options = options
        self._client: MqttClient | None = None
        self._published_once = False
        self._alerts_key = ""
        self._http: HttpServer | None = None
        self.router = Router()
        self.router.add("GET", "/metrics", self._metrics)
        self.router.add("GET", "/fleet", self._fleet)
        self.router.add("GET", "/v2/health/live", self._live)
        self.http_port: int | None = None

    async def start(self) -> None:
        self.core.started = time.monotonic()
        self._client = new_client(
            self.options.broker,
            self.options.client_id,
            keepalive_s=15,
            reconnect_min_s=0.5,
            will=Will(CONTROLLER_TOPIC, json.dumps({"state": "offline"}).encode()),
            on_connect=self._on_connect,
            on_message=self._on_message,
        )
        await self._client.start(wait_s=0)
        if self.options.http_port is not None:
            self._http = HttpServer(self)
            self.http_port = await self._http.start(self.options.http_host, self.options.http_port)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.tick(time.monotonic())
            try:
                await asyncio.wait_for(stop.wait(), STEP_S)
            except TimeoutError:
                pass

    @property
    def connected(self) -> bool:
        return self._client is not None and self._client.connected

    def tick(self, now: float) -> None:
        if not self.connected:
            return
        step = self.core.step(now)
        if step is not None:
            document = json.dumps(step.placement.to_dict()).encode()
            self._publish(PLACEMENT_TOPIC, document)
            self._published_once = True
            for move in step.moves:
                log.info("move: %s %s on %s", move.op, move.model, move.node)
        alerts = self.core.alerts()
        key = json.dumps([a.to_dict() for a in alerts], sort_keys=True)
        # re-published whenever the figures change; logged when the set of alerts changes
        kinds = sorted((a.model, a.kind) for a in alerts)
        if kinds != getattr(self, "_alert_kinds", None):
            for alert in alerts:
                log.warning("alert %s: %s", alert.kind, alert.message)
            self._alert_kinds = kinds
        if key != self._alerts_key:
            self._alerts_key = key
            self._publish(ALERTS_TOPIC, key.encode())

    def _publish(self, topic: str, payload: bytes) -> None:
        assert self._client is not None
        self._client.publish(topic, payload, retain=True)

    async def close(self) -> None:
        client = self._client
        if client is not None:
            acked = client.publish(
                CONTROLLER_TOPIC, json.dumps({"state": "offline"}).encode(), retain=True
            )
            if acked is not None:
                try:
                    await asyncio.wait_for(acked, 2.0)
                except (TimeoutError, FerryError):
                    pass
            await client.close()
        if self._http is not None:
            await self._http.close()

    # ---- broker events (on the loop) ---------------------------------------------------------
    def _on_connect(self) -> None:
        assert self._client is not None
        self._client.subscribe(STATUS_PATTERN, PLACEMENT_TOPIC)
        self._client.publish(
            CONTROLLER_TOPIC, json.dumps({"state": "online"}).encode(), retain=True
        )
        current = self.core.current
        if current is not None:
            # Back from a broker that may have lost its retained messages (restarted
            # without its store): the placement in force is retained again, so a node
            # that restarts while this controller is down still finds it.
            self._publish(PLACEMENT_TOPIC, json.dumps(current.to_dict()).encode())

    def _on_message(self, message: Publish) -> None:
        self._handle(message.topic, message.payload)

    def _handle(self, topic: str, payload: bytes) -> None:
        try:
            document = decode_document(payload)
        except ConfigError as exc:
            log.warning("ignoring %s: %s", topic, exc.message)
            return
        if topic == PLACEMENT_TOPIC:
            if not self._published_once:
                self.core.on_retained_placement(document)
            return
        node = node_from_status_topic(topic)
        if node:
            self.core.on_status(node, document)

    # ---- HTTP (a RoutedApp: /metrics, /fleet, /v2/health/live) ------------------------------
    async def _metrics(self, request: Request) -> Response:
        body, content_type = render_controller_metrics(self.core)
        return Response(200, body, content_type=content_type)

    async def _fleet(self, request: Request) -> Response:
        from cloud.controller.table import fleet_document

        return json_response(fleet_document(self.core.view, self.core.alerts()))

    async def _live(self, request: Request) -> Response:
        return json_response({"live": True, "broker": self.connected})


async def run_controller(core: ControllerCore, options: ControllerOptions) -> int:
    service = ControllerService(core, options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    http = f" http=http://{options.http_host}:{service.http_port}" if service.http_port else ""
    print(
        f"ferry-controller ready broker={options.broker.host}:{options.broker.port}"
        f" models={len(core.catalogue)}{http}",
        flush=True,
    )
    await service.run(stop)
    await service.close()
    print("ferry-controller stopped", flush=True)
    return 0
