"""A node that follows the controller's placement (``ferry-cloud serve --controller``).

The controller publishes the placement retained on ``ferry/v1/placement``; a
node converges to its share of it, one model at a time:

- **add**: load the model (sessions built and warmed on zeros), then take its
  requests (subscribe its shared topic): nothing is subscribed that cannot run;
- **drop**: make before break: wait until another node reports the model
  loaded (or the placement no longer holds it anywhere), stop taking its
  requests (unsubscribe and wait for the broker's UNSUBACK), let the requests
  already received finish, then unload.  A request that still reaches this
  node afterwards is forwarded to a node that hosts the model.

Static stability: the placement is retained, so a node that (re)starts while
the controller is down still finds it and serves its share; nothing here
needs the controller to be alive.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from cloud.dataplane import DataPlane
from cloud.fleet.forwarder import Forwarder
from cloud.fleet.view import FleetView
from cloud.mqtt_front import MqttFront
from cloud.placement.types import Copy, Placement
from shared.errors import ConfigError, FerryError
from shared.mqtt import PLACEMENT_TOPIC, PREFIX, node_from_status_topic
from shared.mqtt.documents import decode_document

log = logging.getLogger(__name__)

#: how long a dropped model waits for its new home to report it loaded
HANDOVER_TIMEOUT_S = 30.0
#: a placed model whose load failed is tried again on this node after this long
RETRY_FAILED_S = 30.0
#: a node leaving waits this long for the controller to name new homes for its models
REPLACE_WAIT_S = 5.0
STATUS_PATTERN = f"{PREFIX}/nodes/+/status"


class PlacementFollower:
    def __init__(
        self,
        dataplane: DataPlane,
        front: MqttFront,
        node: str,
        capacity: Callable[[], dict[str, Any]],
        *,
        http_address: Callable[[], str | None] = lambda: None,
        handover_timeout_s: float = HANDOVER_TIMEOUT_S,
    ) -> None:
        self.dataplane = dataplane
        self.front = front
        self.node = node
        self.capacity = capacity
        self.http_address = http_address
        self.handover_timeout_s = handover_timeout_s
        self.view = FleetView()
        self.forwarder = Forwarder(front, self.view, node, front.limits)
        self.following: int | None = None  # generation converged to
        # ready (as Kubernetes reads /v2/health/ready): a placement seen and each model it
        # gives this node loaded or failed, once; an empty node had been ready at once, so
        # a rolling update took the node hosting every model down beside it
        self.settled = False
        self.load_seconds: dict[str, float] = {}  # last load latency per model
        self.loads = 0
        self.unloads = 0
        self.load_failures: dict[str, str] = {}
        self._failed_at: dict[str, float] = {}  # model -> when its load last failed
        self._drop_started: dict[str, float] = {}
        self._left_at: tuple[float, int | None] = (0.0, None)  # (when, placement then)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Hook into the dataplane and the MQTT front (before the front connects)."""
        self.dataplane.remote = self.forwarder
        self.dataplane.status_extras.append(self._status_extra)
        self.dataplane.readiness_gates.append(lambda: self.settled)
        self.front.catching = self._catching
        self.forwarder.start()
        self.front.add_handler(PLACEMENT_TOPIC, self._on_placement)
        self.front.add_handler(STATUS_PATTERN, self._on_status)
        self.front.on_connected(lambda: self.view.connected(time.monotonic()))
        self._task = asyncio.create_task(self._run())

    async def hand_over(self, until: float) -> None:
        """Before a drain: say this node is leaving (the controller re-homes its copies)
        and keep serving until each model it is the last loaded host of is loaded on a
        node the placement gives it, or ``until`` (monotonic).  A SIGTERM had dropped a
        model's last loaded copy while its new home still loaded it: with min_copies = 2,
        a rolling update left a slow-loading model on no node for 20 s."""
        self.dataplane.leaving = True
        self.front.publish_status()
        placement = self.view.placement
        self._left_at = (time.monotonic(), placement.generation if placement else None)
        while True:
            waiting = self._only_host_of()
            if not waiting:
                return
            if time.monotonic() >= until:
                log.warning(
                    "leaving while the last loaded copy of %s: their new homes are not "
                    "ready (raise shutdown_grace_s past the slowest model's load)",
                    ", ".join(waiting),
                )
                return
            await asyncio.sleep(0.2)

    def _only_host_of(self) -> list[str]:
        """Models loaded here, loaded nowhere else, that the placement keeps (a model it
        places nowhere has no new home to wait for)."""
        placement = self.view.placement
        if placement is None:
            return []
        left_at, generation = self._left_at
        replacing = placement.generation == generation  # (the controller has not answered)
        fresh = time.monotonic() - left_at < REPLACE_WAIT_S
        waiting = []
        for name in self.dataplane.loaded_names():
            if self.view.hosts(name, exclude=self.node):
                continue
            elsewhere = [c for c in placement.copies_of(name) if c.node != self.node]
            # a new home loading it, or a controller given a moment to name one (one
            # that names none, or is down, leaves nothing to wait for)
            if elsewhere or (replacing and fresh and placement.copies_of(name)):
                waiting.append(name)
        return waiting

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    # ---- messages (on the loop) ------------------------------------------------------
    def _on_placement(self, topic: str, payload: bytes | None, properties: Any) -> None:
        if payload is None:
            log.error("ignoring a placement over this node's body limit")
            return
        try:
            self.view.on_placement(decode_document(payload))
        except ConfigError as exc:
            log.error("ignoring a malformed placement: %s", exc.message)
            return
        self.front.resync()  # (the models placed nowhere may have changed)
        self._wake.set()

    def _catching(self) -> list[str]:
        """The repository's models no other node serves now: placed nowhere, or placed
        and not loaded anywhere yet (until its host reports it, requests for it had no
        subscriber).  Their requests are taken here: answered "not ready", counted as
        misses (this node's own loaded models are served, never caught)."""
        placement = self.view.placement
        if placement is None:
            return []
        models = set(placement.unplaced) | {c.model for c in placement.copies}
        return sorted(n for n in models if not self.view.hosts(n))

    def _on_status(self, topic: str, payload: bytes | None, properties: Any) -> None:
        now = time.monotonic()
        node = node_from_status_topic(topic)
        if node and node != self.node and payload is not None:
            try:
                document = decode_document(payload)
            except ConfigError:
                document = None
            if document is not None:
                was_online = node in self.view.nodes and self.view.nodes[node].online
                self.view.on_status(node, document, now)
                if was_online and not self.view.nodes[node].online:
                    self.forwarder.node_lost(node)
                else:
                    self.forwarder.hosts_changed()
                self.front.resync()  # (a model's host came or went: catch it, or stop)
                self._wake.set()  # a handover may be waiting for this node
        # Statuses come every few seconds (this node's own too): each, once folded, is the
        # moment to drop nodes that went silent (dead while the broker was down: no will).
        gone = self.view.expire(now)
        for name in gone:
            self.forwarder.node_lost(name)
        if gone:
            self.front.resync()  # (its models may have no host left: catch them)
            self._wake.set()

    def _status_extra(self) -> dict[str, Any]:
        metadata, configs = self.dataplane.describe_loaded()
        return {
            "capacity": self.capacity(),
            "following": self.following,
            # the newest placement seen (following lags it while loads run): a controller
            # that lost the retained one numbers above both
            "received": self.view.placement.generation if self.view.placement else None,
            "misses": dict(self.forwarder.misses),
            "metadata": metadata,
            "configs": configs,
            "http": self.http_address(),
            "load_seconds": {k: round(v, 3) for k, v in self.load_seconds.items()},
            # placed here, not loaded: the controller places them elsewhere
            "load_failures": dict(self.load_failures),
            # placed nowhere: requests for them are taken to count the demand (agents
            # send them rather than refuse them unsent)
            "catching": self.front.caught,
        }

    # ---- convergence -------------------------------------------------------------------
    def mine(self, placement: Placement) -> dict[str, Copy]:
        return {c.model: c for c in placement.on_node(self.node)}

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            placement = self.view.placement
            if placement is None:
                continue
            try:
                done = await self._converge(placement)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad step stop the follower
                log.exception("placement step failed; retrying")
                done = False
            if not self.settled:
                tried = set(self.dataplane.loaded_names()) | set(self.load_failures)
                if set(self.mine(placement)) <= tried:
                    self.settled = True
                    log.info("node %s holds its share of the placement: ready", self.node)
            if done and self.view.placement is placement:
                if self.following != placement.generation:
                    self.following = placement.generation
                    log.info("node %s follows placement %d", self.node, placement.generation)
                    self.front.publish_status()
            elif not self._wake.is_set():
                # waiting on a handover or a failed load: look again shortly
                asyncio.get_running_loop().call_later(0.5, self._wake.set)

    async def _converge(self, placement: Placement) -> bool:
        wanted = self.mine(placement)
        loaded = set(self.dataplane.loaded_names())
        done = True
        for name in sorted(set(self.load_failures) - set(wanted)):
            # placed elsewhere now: its failure is no longer this node's (readiness)
            self.load_failures.pop(name, None)
            self._failed_at.pop(name, None)
            try:
                await self.dataplane.unload(name)
            except FerryError:
                pass
            self.front.publish_status()
        now = time.monotonic()
        for name in sorted(set(wanted) - loaded):
            if self.view.placement is not placement:
                return False  # a newer placement arrived: start over from it
            if now - self._failed_at.get(name, -RETRY_FAILED_S) < RETRY_FAILED_S:
                done = False  # failed a moment ago: not again at once (a corrupt file)
                continue
            done &= await self._add(wanted[name])
        for name in sorted(loaded - set(wanted)):
            if self.view.placement is not placement:
                return False
            done &= await self._drop(name, placement)
        return done

    async def _add(self, copy: Copy) -> bool:
        config = None
        try:
            base = self.dataplane.repository.read_config(copy.model)
            if copy.backend and base.backend != copy.backend:
                config = replace(base, backend=copy.backend)
        except FerryError as exc:
            self._load_failed(copy.model, exc.message)
            return False
        started = time.monotonic()
        try:
            await self.dataplane.load(copy.model, config)
        except FerryError as exc:
            self._load_failed(copy.model, exc.message)
            return False
        self.load_seconds[copy.model] = time.monotonic() - started
        self.load_failures.pop(copy.model, None)
        self._failed_at.pop(copy.model, None)
        self.loads += 1
        self.front.release(copy.model)  # subscribed only now that it is warm
        self.forwarder.hosts_changed()  # requests that waited for a home for it
        log.info(
            "placed %s here (%s, %.2f s to load and warm)",
            copy.model,
            copy.backend,
            self.load_seconds[copy.model],
        )
        return True

    def _load_failed(self, name: str, reason: str) -> None:
        first = self.load_failures.get(name) != reason
        if first:
            log.error("model %s placed here but not loaded: %s", name, reason)
        self.load_failures[name] = reason
        self._failed_at[name] = time.monotonic()
        self.dataplane.mark_failed(name, reason)  # (read_config's failures count too)
        if first:
            self.front.publish_status()  # the controller moves it without waiting

    async def _drop(self, name: str, placement: Placement) -> bool:
        elsewhere = [c.node for c in placement.copies_of(name) if c.node != self.node]
        if elsewhere and not self.view.hosts(name, exclude=self.node):
            waited = time.monotonic() - self._drop_started.setdefault(name, time.monotonic())
            if waited < self.handover_timeout_s:
                return False  # its new home is still loading it: keep serving
            log.warning("model %s: no other node reports it after %.0f s; dropping", name, waited)
        self._drop_started.pop(name, None)
        await self.front.withhold(name)
        try:
            await self.dataplane.unload(name)
        except FerryError:
            pass  # already gone
        self.front.release(name)
        self.unloads += 1
        log.info("moved %s away from this node", name)
        return True
