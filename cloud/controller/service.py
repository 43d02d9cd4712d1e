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
import math
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloud.controller.catalogue import ModelEntry
from cloud.controller.core import ControllerCore
from cloud.controller.metrics import render_controller_metrics
from cloud.fleet.follower import STATUS_PATTERN
from cloud.mqtt_front import new_client
from shared.aio.http_server import HttpServer, Request, Response, RoutedApp, Router, json_response
from shared.aio.mqtt import MqttClient
from shared.aio.signals import stop_on_signals
from shared.errors import ConfigError, FerryError
from shared.mqtt import (
    ALERTS_TOPIC,
    CONTROLLER_TOPIC,
    PLACEMENT_TOPIC,
    BrokerAddress,
    node_from_status_topic,
)
from shared.mqtt.codec import Publish, Will
from shared.mqtt.documents import decode_document

log = logging.getLogger(__name__)

STEP_S = 0.5


#: after a (re)connect, how long to wait for the retained placement before restoring ours
RETAINED_WAIT_S = 1.0
#: how often the repository is read again for models added, removed or re-configured
RESCAN_S = 10.0
#: After the controller's own reconnection, how long its nodes may take to be back: their
#: reconnect backoff (MqttClient: at most 5 s, +25% jitter) and their first status.
NODES_BACK_WITHIN_S = 8.0


@dataclass(frozen=True)
class ControllerOptions:
    broker: BrokerAddress
    # each controller its own (a broker that takes ids from user names gives one per user)
    client_id: str = field(
        default_factory=lambda: f"ferry-controller-{socket.gethostname()}-{os.getpid()}"
    )
    # the broker's TLS (an mqtts:// broker), as a node's [mqtt] table gives them
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    tls_insecure: bool = False
    keepalive_s: int = 15
    http_host: str = "127.0.0.1"
    http_port: int | None = 8001  # None: no HTTP endpoint
    # the repository read again every RESCAN_S: (entries, problems), off the loop
    rescan: Callable[[], tuple[dict[str, ModelEntry], dict[str, str]]] | None = None
    # the active controller says it is alive this often; a standby takes over after
    # three missed (a will can be lost: a broker down when its controller died)
    heartbeat_s: float = 5.0


class ControllerService(RoutedApp):
    def __init__(self, core: ControllerCore, options: ControllerOptions) -> None:
        self.core = core
        self.options = options
        self._client: MqttClient | None = None
        self._alerts_key = ""
        self._retry_at = 0.0  # (monotonic) a placement that raised is tried again from here
        self._http: HttpServer | None = None
        self.router = Router()
        self.router.add("GET", "/metrics", self._metrics)
        self.router.add("GET", "/fleet", self._fleet)
        self.router.add("GET", "/v2/health/live", self._live)
        self.http_port: int | None = None
        # One controller places at a time: the others stand by, warm, until its last
        # will says it is gone.  The earliest started stays (ties: the smaller id).
        self.since = time.time()
        self.active = True
        self._leader: str | None = None  # the controller this one stands behind
        self._leader_key: tuple[float, str] = (math.inf, "")
        self._leader_seen = 0.0  # when its status last came (monotonic)
        self._beat = -math.inf  # when this one last said it is alive
        self._rescan_task: asyncio.Task[None] | None = None
        self._scan_now = False  # SIGHUP: read the repository at the next step
        self._removing: set[str] = set()  # models one scan found gone (a second confirms)
        # after a (re)connect: when to put ours back as the retained placement, unless
        # the broker's (its generation, once read) is as new
        self._republish_at: float | None = None
        self._retained_generation: int | None = None
        self._connections = 0
        self.refused_publishes = 0
        self._refusal_logged: dict[str, float] = {}

    async def start(self) -> None:
        self.core.started = time.monotonic()
        self._client = new_client(
            self.options.broker,
            self.options.client_id,
            ca_file=self.options.ca_file,
            insecure=self.options.tls_insecure,
            cert_file=self.options.cert_file,
            key_file=self.options.key_file,
            keepalive_s=self.options.keepalive_s,
            reconnect_min_s=0.5,
            will=Will(CONTROLLER_TOPIC, self._status("offline")),
            on_connect=self._on_connect,
            on_message=self._on_message,
        )
        await self._client.start(wait_s=0)
        if self.options.http_port is not None:
            self._http = HttpServer(self)
            self.http_port = await self._http.start(self.options.http_host, self.options.http_port)

    def rescan_soon(self) -> None:
        """Read the repository at the next step, not only every RESCAN_S (SIGHUP)."""
        if self.options.rescan is None:
            log.info("SIGHUP: this controller has no repository to read again")
            return
        log.info("SIGHUP: reading the repository again")
        self._scan_now = True

    async def run(self, stop: asyncio.Event) -> None:
        last_scan = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            due = now - last_scan >= RESCAN_S or self._scan_now
            if self.options.rescan is not None and due:
                last_scan, self._scan_now = now, False
                if self._rescan_task is None or self._rescan_task.done():
                    self._rescan_task = asyncio.create_task(self._rescan())
            self.tick(now)
            try:
                await asyncio.wait_for(stop.wait(), STEP_S)
            except TimeoutError:
                pass
        if self._rescan_task is not None:
            await asyncio.gather(self._rescan_task, return_exceptions=True)

    async def _rescan(self) -> None:
        assert self.options.rescan is not None
        try:
            entries, problems = await asyncio.to_thread(self.options.rescan)
        except Exception as exc:  # a repository gone for a moment keeps the catalogue
            log.warning("repository not read again: %s", exc)
            return
        known = self.core.catalogue
        for name in problems:
            if name in known:  # (a config caught half-written): keep what is placed
                entries[name] = known[name]
        gone = set(known) - set(entries)
        # A model goes once two scans in a row miss it, and never all at once (an
        # unmounted volume reads as an empty repository): nodes keep serving meanwhile.
        confirmed = gone & self._removing
        self._removing = gone - confirmed
        if len(confirmed) == len(known) and known:
            log.warning("the repository reads empty: keeping the %d models placed", len(known))
            confirmed = set()
        for name in gone - confirmed:
            entries[name] = known[name]
        added, removed = self.core.on_catalogue(entries)
        for name in added:
            log.info("model %s added to the repository", name)
        for name in removed:
            log.warning("model %s is no longer in the repository: unplaced", name)

    @property
    def connected(self) -> bool:
        return self._client is not None and self._client.connected

    def tick(self, now: float) -> None:
        if not self.connected:
            return
        if not self.active:
            silent = now - self._leader_seen
            if silent <= 3 * self.options.heartbeat_s:
                return
            log.warning("controller %s silent for %.0f s: placing", self._leader, silent)
            self._take_over()
        if self._republish_at is not None and now >= self._republish_at:
            self._republish_at = None
            current = self.core.current
            retained = self._retained_generation
            if current is not None and (retained is None or retained < current.generation):
                self._publish(PLACEMENT_TOPIC, json.dumps(current.to_dict()).encode())
        if now - self._beat >= self.options.heartbeat_s:
            self._beat = now
            assert self._client is not None
            self._publish(CONTROLLER_TOPIC, self._status("online"))
        step = None
        if now >= self._retry_at:
            try:
                step = self.core.step(now)
            except Exception:  # a bug, or an input no check foresaw: the placement in
                # force stands (the nodes go on serving it) and the controller stays up
                # to retry; it had exited, and a retained status brought it down again
                # at each restart
                log.exception("placement not recomputed; the one in force stands")
                self._retry_at = now + self.core.settings.interval_s
        if step is not None:
            document = json.dumps(step.placement.to_dict()).encode()
            self._publish(PLACEMENT_TOPIC, document)
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
        try:
            self._client.publish(
                topic, payload, retain=True, on_ack=lambda outcome: self._acked(topic, outcome)
            )
        except FerryError as exc:  # (the broker takes nothing now; a stalled connection is
            # dropped, and the placement in force is retained again on the next one)
            log.warning("the controller's publish on %s not sent: %s", topic, exc.message)

    def _acked(self, topic: str, outcome: Any) -> None:
        """A publish the broker refused is said (rate-limited per topic): a controller
        without the ACL to publish had logged its placements as made, none reaching
        a node."""
        if isinstance(outcome, BaseException) or outcome < 0x80:
            return
        self.refused_publishes += 1
        now = time.monotonic()
        if now - self._refusal_logged.get(topic, -math.inf) >= 30.0:
            self._refusal_logged[topic] = now
            why = "not authorized by its ACL" if outcome == 0x87 else "refused"
            log.error(
                "the broker refused the controller's publish on %s: reason 0x%02x, %s "
                "(a controller's user needs the controller role: ferry-cloud auth --controller)",
                topic,
                outcome,
                why,
            )

    async def close(self) -> None:
        client = self._client
        if client is not None:
            was_active, self.active = self.active, False  # (a successor's status: no reply)
            try:
                acked = (
                    client.publish(CONTROLLER_TOPIC, self._status("offline"), retain=True)
                    if was_active
                    else None
                )
            except FerryError:  # (its last will says it instead; the client still closes)
                acked = None
            if acked is not None:
                try:
                    await asyncio.wait_for(acked, 2.0)
                except (TimeoutError, FerryError):
                    pass
            await client.close()
        if self._http is not None:
            await self._http.close()

    # ---- broker events (on the loop) ---------------------------------------------------------
    def _status(self, state: str) -> bytes:
        doc = {"state": state, "id": self.options.client_id, "since": self.since}
        return json.dumps(doc).encode()

    def _on_connect(self) -> None:
        assert self._client is not None
        self._client.subscribe(STATUS_PATTERN, PLACEMENT_TOPIC, CONTROLLER_TOPIC)
        now = time.monotonic()
        if self._connections:  # back after losing the broker: let the nodes come back too
            self.core.reconnected(now, NODES_BACK_WITHIN_S)
        else:
            self.core.view.connected(now)  # (nodes' silence counts from now)
        self._connections += 1
        self._leader_seen = time.monotonic()  # (a grace: its status arrives after this)
        if not self.active:
            return  # standing by: the active one's status and placement stay retained
        self._publish(CONTROLLER_TOPIC, self._status("online"))
        # Back from a broker that may have lost its retained messages (restarted
        # without its store): the placement in force is retained again, so a node that
        # restarts while this controller is down still finds it; unless the broker holds
        # a newer one (another controller's, placed meanwhile), which is adopted instead.
        self._retained_generation = None
        self._republish_at = time.monotonic() + RETAINED_WAIT_S

    def _on_message(self, message: Publish) -> None:
        self._handle(message.topic, message.payload)

    def _handle(self, topic: str, payload: bytes) -> None:
        try:
            document = decode_document(payload)
        except ConfigError as exc:
            log.warning("ignoring %s: %s", topic, exc.message)
            return
        if topic == PLACEMENT_TOPIC:
            # adopted when newer than ours (another controller's, while this one stood
            # by or was cut off): the count goes on from the nodes' newest
            try:
                self.core.on_retained_placement(document)
            except ConfigError as exc:  # (a hand-made or foreign publish: one line, no trace)
                log.warning("ignoring the placement on %s: %s", topic, exc.message)
                return
            if isinstance(document, dict) and isinstance(document.get("generation"), int):
                seen = document["generation"]
                if self._retained_generation is None or seen > self._retained_generation:
                    self._retained_generation = seen
            return
        if topic == CONTROLLER_TOPIC:
            self._on_controller(document)
            return
        node = node_from_status_topic(topic)
        if node:
            self.core.on_status(node, document, time.monotonic())

    def _on_controller(self, document: object) -> None:
        """A controller's status: stand by behind an earlier one, take over when the one
        stood behind says it is gone (its goodbye or last will), and keep ours retained
        while active (a standby's will overwrites it)."""
        if not isinstance(document, dict) or self._client is None:
            return
        other = str(document.get("id", ""))
        if other == self.options.client_id:
            return
        since = document.get("since")
        key = (float(since), other) if isinstance(since, int | float) else None
        mine = (self.since, self.options.client_id)
        if document.get("state") == "online":
            if key is None or key > mine:
                if self.active:  # a later one: it stands by once it reads ours
                    self._publish(CONTROLLER_TOPIC, self._status("online"))
                return
            if self.active:
                log.warning("controller %s is placing: standing by", other)
                self.active = False
            if self._leader is None or self._leader == other or key < self._leader_key:
                self._leader, self._leader_key = other, key
            if self._leader == other:
                self._leader_seen = time.monotonic()
        elif self.active:
            self._publish(CONTROLLER_TOPIC, self._status("online"))
        elif other == self._leader:
            log.warning("controller %s is gone: placing from its placement", other)
            self._take_over()

    def _take_over(self) -> None:
        self.active = True
        self._leader = None
        self.core.last_step = -math.inf
        self._beat = time.monotonic()
        if self._client is not None:
            self._publish(CONTROLLER_TOPIC, self._status("online"))

    # ---- HTTP (a RoutedApp: /metrics, /fleet, /v2/health/live) ------------------------------
    async def _metrics(self, request: Request) -> Response:
        body, content_type = render_controller_metrics(self.core)
        return Response(200, body, content_type=content_type)

    async def _fleet(self, request: Request) -> Response:
        from cloud.controller.table import fleet_document

        return json_response(fleet_document(self.core.view, self.core.alerts()))

    async def _live(self, request: Request) -> Response:
        return json_response({"live": True, "broker": self.connected, "active": self.active})


async def run_controller(core: ControllerCore, options: ControllerOptions) -> int:
    service = ControllerService(core, options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    stop_on_signals(stop, "it ends within a second or two")
    # SIGHUP's default killed the controller (its will published "offline"): it reads
    # the repository again now, as a standalone node does on SIGHUP.
    loop.add_signal_handler(signal.SIGHUP, service.rescan_soon)
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
