"""The cloud node's lifecycle: build the layers, serve, shut down in order.

Start: repository -> dataplane (models loaded) -> metrics -> HTTP site ->
MQTT front.  Stop (SIGTERM/SIGINT), in three steps:

1. stop intake on both fronts at once: the dataplane refuses new requests
   (readiness turns false, a request on a kept-alive connection gets 503),
   the HTTP listening socket closes (new connections are refused) and the
   MQTT front unsubscribes (requests that still arrive get "unavailable");
2. drain both fronts concurrently, waiting for every request received,
   including the ones that arrived during the drain, up to
   ``shutdown_grace_s``;
3. close the runtimes, then leave the broker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time

from cloud.config import CloudConfig
from cloud.cpu import CpuMonitor
from cloud.dataplane import DataPlane
from cloud.fleet.follower import PlacementFollower
from cloud.gpu import GpuMonitor
from cloud.http_front import HttpFront
from cloud.metrics import make_registry, render_metrics
from cloud.mqtt_front import MqttFront
from shared.admission import ByteBudget
from shared.aio.http_server import (
    CUT_ANSWER_S,
    HttpServer,
    ServerOptions,
    check_listen,
    default_max_connections,
)
from shared.aio.signals import stop_on_signals
from shared.errors import FerryError
from shared.heap import trim_heap
from shared.repository import ModelRepository
from shared.repository.capacity import available_memory
from shared.runtimes import installed_backends
from shared.tokens import TokensFile, follow_tokens

log = logging.getLogger(__name__)


class CloudServer:
    def __init__(self, config: CloudConfig) -> None:
        self.config = config
        self.dataplane = DataPlane(
            ModelRepository(config.repository),
            config.node,
            default_max_queue=config.max_queue_size,
            strict_readiness=config.strict_readiness,
            idempotency_ttl_s=config.idempotency_ttl_s,
            idempotency_max_entries=config.idempotency_max_entries,
            idempotency_max_bytes=config.idempotency_max_bytes,
            max_elements=config.limits.max_elements,
            inline_run_us=config.inline_run_us,
            turns=config.fleet is not None and config.fleet.turns,
        )
        self.gpu = GpuMonitor()
        self.cpu = CpuMonitor()
        self.budget = ByteBudget(config.max_inflight_bytes)
        self.http: HttpServer | None = None
        self.mqtt: MqttFront | None = None
        self.follower: PlacementFollower | None = None
        self._memory_for_models: int | None = None
        self.http_port: int | None = None
        self._following: asyncio.Task[None] | None = None

    async def start(self) -> None:
        cfg = self.config
        self.gpu.start()
        if not self.gpu.available:
            log.info("%s", self.gpu.reason)
        if cfg.fleet is not None:
            names = []  # the controller's placement says what this node loads
        elif cfg.models is not None:
            names = list(cfg.models)
        else:
            names = self.dataplane.repository.model_names()
        if cfg.http is not None:  # (a taken port said before the loads, not after them)
            await asyncio.to_thread(check_listen, cfg.http.host, cfg.http.port)
        self.dataplane.plan(names)
        for name in names:
            try:
                await self.dataplane.load(name)
            except FerryError as exc:
                log.error("model %s not loaded: %s", name, exc.message)
                self.dataplane.mark_failed(name, exc.message)
        self.dataplane.end_plan()
        if names:  # what loading freed goes back to the system, once, before any request:
            # a trim holds the allocator's lock (~80 ms on a 400 MB heap), so never later
            await asyncio.get_running_loop().run_in_executor(None, trim_heap)
        if cfg.http is not None:
            registry = make_registry(self.dataplane.all_stats, self.gpu, self.cpu)
            tokens_file = TokensFile(cfg.http.tokens_file) if cfg.http.tokens_file else None
            front = HttpFront(
                self.dataplane,
                limits=cfg.limits,
                tokens=tokens_file.tokens if tokens_file is not None else None,
                open_metrics=cfg.http.open_metrics,
                metrics=lambda: render_metrics(registry),
                budget=self.budget,
            )
            self.http = HttpServer(
                front,
                ServerOptions(
                    max_body_bytes=cfg.limits.max_body_bytes,
                    header_timeout_s=cfg.http.header_timeout_s,
                    body_timeout_s=cfg.http.body_timeout_s,
                    idle_timeout_s=cfg.http.idle_timeout_s,
                    max_connections=cfg.http.max_connections or default_max_connections(),
                ),
            )
            self.http_port = await self.http.start(cfg.http.host, cfg.http.port)
            if tokens_file is not None:  # (a revoked token stops working within a second)
                self._following = asyncio.create_task(
                    follow_tokens(tokens_file, lambda tokens: setattr(front, "tokens", tokens))
                )
        if cfg.mqtt is not None:
            self.mqtt = MqttFront(
                self.dataplane,
                cfg.mqtt,
                cfg.limits,
                cfg.node,
                max_inflight=cfg.max_inflight_mqtt,
                budget=self.budget,
            )
            if cfg.fleet is not None:
                self.follower = PlacementFollower(
                    self.dataplane,
                    self.mqtt,
                    cfg.node,
                    self._capacity,
                    http_address=self._http_address,
                    handover_timeout_s=cfg.fleet.handover_timeout_s,
                )
                self.follower.start()
            await self.mqtt.start()

    async def rescan(self) -> None:
        """Reload what changed in the repository (every model's folder where the config
        loads every model, else only those loaded or failed); said in the log."""
        try:
            done = await self.dataplane.rescan(every_model=self.config.models is None)
        except (FerryError, OSError) as exc:
            log.error("rescan failed: %s", exc)
            return
        # (what failed was logged as it failed, with why: counted here, not said twice)
        said = [
            f"{what} {', '.join(names)}" if what != "failed" else f"{len(names)} failed"
            for what, names in done.items()
            if names
        ]
        level = logging.WARNING if done.get("failed") else logging.INFO
        log.log(level, "rescanned the repository: %s", "; ".join(said) or "nothing changed")

    def _capacity(self) -> dict[str, object]:
        """What the controller may fill on this node (the status reports it)."""
        assert self.config.fleet is not None
        if self._memory_for_models is None:
            self._memory_for_models = self.config.fleet.memory_bytes or available_memory()
        backends = [b for b in installed_backends() if b != "tensorrt" or self.gpu.available]
        return {
            "cores": self.dataplane.cores,
            "memory_bytes": self._memory_for_models,
            "backends": backends,
            "speed": self.config.fleet.speed,
            "gpu": self.gpu.reason if self.gpu.available else None,
        }

    def _http_address(self) -> str | None:
        if self.http_port is None or self.config.http is None:
            return None
        return f"http://{self.config.http.host}:{self.http_port}"

    async def stop(self) -> None:
        """Stop within ``shutdown_grace_s``, end to end: every step gets what is left."""
        deadline = time.monotonic() + self.config.shutdown_grace_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        # 0. in a fleet: the models this node alone holds get a new home first (two
        #    thirds of the grace at most; the drain has the rest)
        if self.follower is not None and self.mqtt is not None:
            assert self.config.fleet is not None
            handover = time.monotonic() + self.config.fleet.handover_timeout_s
            await self.follower.hand_over(
                min(handover, deadline - self.config.shutdown_grace_s / 3)
            )
        # 1. intake off everywhere before anything waits
        if self._following is not None:
            self._following.cancel()
        self.dataplane.begin_shutdown()
        if self.http is not None:
            self.http.stop_listening()  # new connections refused; open ones stay
        if self.mqtt is not None:
            self.mqtt.stop_intake()
        if self.follower is not None:
            await self.follower.stop()
        # 2. drain both fronts at once. Kept-alive connections linger (answers carry
        #    Connection: close; a request already on its way gets 503, not a reset),
        #    then idle ones are closed and running handlers awaited.
        #    What is still going at the end is answered shutting_down, which takes a
        #    moment of its own: kept inside the grace.
        drains = []
        answers_by = deadline - min(CUT_ANSWER_S, self.config.shutdown_grace_s / 4)
        if self.http is not None:
            assert self.config.http is not None
            linger = self.config.http.shutdown_linger_s
            drains.append(self.http.drain(answers_by, linger_s=linger))
        if self.mqtt is not None:
            drains.append(self.mqtt.drain(answers_by))
        await asyncio.gather(*drains)
        # 3. runtimes, then the broker, with whatever time is left
        try:
            await asyncio.wait_for(self.dataplane.close(), timeout=left() or 0.001)
        except TimeoutError:
            log.warning("shutdown grace over: runtimes left busy at exit")
        if self.mqtt is not None:
            await self.mqtt.close(timeout_s=min(2.0, left()))
        await self._close_http()
        self.gpu.close()

    async def _close_http(self) -> None:
        if self.http is not None:
            await self.http.close()


async def serve(config: CloudConfig) -> int:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    server = CloudServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    stop_on_signals(stop, f"at most {config.shutdown_grace_s:g} s: shutdown_grace_s")
    # SIGHUP's default killed the node on the spot, requests in flight and all.  Now a
    # standalone node reads its repository again (Triton's poll mode, on demand); in a
    # fleet the controller rescans on its own and places what changed.
    rescans: list[asyncio.Task[None]] = []
    again = asyncio.Event()  # a SIGHUP during a rescan: files may have changed after its look

    async def rescan() -> None:
        while True:
            again.clear()
            await server.rescan()
            if not again.is_set():
                return
            log.info("SIGHUP came during the rescan: rescanning again")

    def hangup() -> None:
        if config.fleet is not None:
            log.warning("SIGHUP ignored: in a fleet the controller rescans the repository")
        elif rescans and not rescans[-1].done():
            # (dropped, a "copy the files, then kill -HUP" landing mid-rescan was never
            # loaded: the running rescan had looked before the files came)
            again.set()
            log.info("SIGHUP: a rescan is under way; another follows it")
        else:
            rescans[:] = [loop.create_task(rescan())]

    loop.add_signal_handler(signal.SIGHUP, hangup)
    await server.start()
    parts = [f"node={config.node}", f"models={','.join(server.dataplane.loaded_names()) or '-'}"]
    if server.http_port is not None:
        assert config.http is not None
        parts.append(f"http=http://{config.http.host}:{server.http_port}")
    if config.mqtt is not None:
        scheme = "mqtts" if config.mqtt.broker.tls else "mqtt"
        parts.append(f"mqtt={scheme}://{config.mqtt.broker.host}:{config.mqtt.broker.port}")
    # One parseable line: tests and the demo read the bound port from it.
    print("ferry-cloud ready " + " ".join(parts), flush=True)
    sys.stdout.flush()
    await stop.wait()
    log.info("shutting down")
    await server.stop()
    print("ferry-cloud stopped", flush=True)
    if server.dataplane.loads_under_way():
        # A load under way cannot be interrupted (a runtime builds its session in one
        # call) and asyncio.run's exit waits for its thread: the stopped process had
        # lived on until the load ended, past the orchestrator's grace to a SIGKILL.
        # Everything is answered and closed by now.
        log.warning("leaving a model load under way at shutdown")
        logging.shutdown()
        sys.stderr.flush()
        os._exit(0)
    return 0
