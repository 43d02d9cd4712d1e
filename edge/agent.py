"""The edge agent: builds the dataplane from ``agent.toml`` and keeps it fed.

Python API::

    agent = Agent(load_agent_config(Path("agent.toml")))
    await agent.start()
    reply = await agent.infer("orientation", {"x": image}, deadline_ms=300)
    reply.parameters["where"]        # "local", "cloud-mqtt", "cloud-http" or "deferred"
    await agent.stop()

Background tasks: link probes, the deferred-request flusher, the estimate
saver and the config watcher (a changed ``agent.toml`` is validated and
swapped in without dropping requests; a bad one is logged and ignored).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from devices.power import read_battery
from devices.profiles import load_device, load_link
from edge.breaker import CircuitBreaker
from edge.config import AgentConfig, load_agent_config
from edge.dataplane import EdgeDataPlane
from edge.deferred import Deferrer
from edge.estimators import Estimators
from edge.local import LocalModels
from edge.policy import LOCAL, Policy
from edge.store import DeferredStore
from edge.transports.base import Transport
from shared.datatypes import numpy_dtype
from shared.errors import FerryError
from shared.messages import InferRequest, InferResponse, RequestedOutput
from shared.mqtt import parse_broker_url
from shared.repository import ModelRepository
from shared.tensors import Tensor

log = logging.getLogger(__name__)


class Battery:
    """Battery level from sysfs, read at most every 30 s (None on mains power)."""

    def __init__(self) -> None:
        self._at = -1e9
        self._value: float | None = None

    def __call__(self) -> float | None:
        now = time.monotonic()
        if now - self._at > 30:
            self._at = now
            reading = read_battery()
            self._value = (
                reading.battery_percent if reading.available and reading.on_battery else None
            )
        return self._value


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        config.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_file = config.state_dir / "estimates.json"
        self.estimators = Estimators.load(self.state_file, time.monotonic())
        self.device = load_device(config.device)
        self.transports: dict[str, Transport] = {}
        if config.cloud.mqtt_url:
            from edge.transports.mqtt import MqttTransport

            self.transports["mqtt"] = MqttTransport(
                parse_broker_url(config.cloud.mqtt_url),
                ca_file=config.cloud.ca_file,
                tls_insecure=config.cloud.tls_insecure,
            )
        if config.cloud.http_url:
            from edge.transports.http import HttpTransport

            self.transports["http"] = HttpTransport(config.cloud.http_url, token=config.cloud.token)
        self.links = {t: load_link(config.links[t]) for t in self.transports}
        for t, link in self.links.items():
            self.estimators.set_link_prior(
                t, link.up_mbps * 1e6, link.down_mbps * 1e6, link.rtt_ms / 1000
            )
        self.local = LocalModels(
            ModelRepository(config.repository),
            config.local_threads,
            config.local_slowdown,
            config.local_latency_ms / 1000.0,
        )
        self.store = DeferredStore(config.state_dir / "deferred.db")
        self.deferrer = Deferrer(self.store)
        self.dataplane = EdgeDataPlane(
            policy=Policy(config.policy, self.estimators, self.device, self.links),
            estimators=self.estimators,
            local=self.local,
            transports=self.transports,
            breakers={t: CircuitBreaker() for t in self.transports},
            deferrer=self.deferrer,
            battery=Battery(),
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._config_mtime = self._mtime()
        self.started_at: float | None = None

    # ---- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        await self._load_local_models(self.config)
        for transport in self.transports.values():
            await transport.start()
        self._tasks = [
            asyncio.create_task(self._every(self.config.probe_interval_s, self.dataplane.probe)),
            asyncio.create_task(self._every(1.0, self.flush_deferred)),
            asyncio.create_task(self._every(10.0, self._save_estimates)),
            asyncio.create_task(self._every(1.0, self._watch_config)),
        ]
        self.started_at = time.monotonic()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._save_estimates()
        for transport in self.transports.values():
            await transport.close()
        self.local.close()
        self.store.close()

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _wanted_local(self, config: AgentConfig) -> list[str]:
        repo = self.local.repository
        if config.policy.models:
            names = {m.local_model for m in config.policy.models.values() if m.local_model}
        else:
            names = set(repo.model_names())
        return sorted(names)

    async def _load_local_models(self, config: AgentConfig) -> None:
        for name in self._wanted_local(config):
            if self.local.has(name):
                continue
            model = await asyncio.to_thread(self.local.load, name)
            await self._warm_up(model.name)

    async def _warm_up(self, name: str) -> None:
        """One run on zeros: pays first-call costs and seeds the latency estimate."""
        model = self.local.get(name)
        cfg = model.config
        inputs = {}
        for spec in cfg.inputs:
            dims = [max(d, 1) for d in spec.dims]
            shape = ([1] if cfg.max_batch_size else []) + dims
            if spec.datatype == "BYTES":
                inputs[spec.name] = np.full(shape, b"", dtype=object)
            else:
                inputs[spec.name] = np.zeros(shape, dtype=numpy_dtype(spec.datatype))
        try:
            for _ in range(2):
                _, seconds = await self.local.run(name, inputs)
            self.estimators.local(name).add(seconds, time.monotonic())
        except FerryError as exc:
            log.warning("warm-up of %s failed: %s", name, exc.message)

    async def _every(self, interval: float, fn: Any) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()
            except Exception:  # a background task must never die
                log.exception("background task %s failed", getattr(fn, "__name__", fn))

    async def _save_estimates(self) -> None:
        await asyncio.to_thread(self.estimators.save, self.state_file)

    def _mtime(self) -> float | None:
        src = self.config.source
        try:
            return src.stat().st_mtime if src else None
        except OSError:
            return None

    async def _watch_config(self) -> None:
        mtime = self._mtime()
        if mtime is None or mtime == self._config_mtime:
            return
        self._config_mtime = mtime
        assert self.config.source is not None
        try:
            new = load_agent_config(self.config.source)
            await self._load_local_models(new)
        except FerryError as exc:
            log.error("agent config not reloaded, keeping the running one: %s", exc.message)
            return
        if new.cloud != self.config.cloud or new.links != self.config.links:
            log.warning("cloud endpoints and links changed: they take effect after a restart")
        self.dataplane.policy = Policy(new.policy, self.estimators, self.device, self.links)
        self.config = new
        log.info("agent config reloaded from %s", new.source)

    async def flush_deferred(self) -> None:
        dp = self.dataplane

        def can_send() -> bool:
            return any(dp.usable(time.monotonic()).values())

        if not can_send():
            return

        async def send(model: str, request: InferRequest) -> InferResponse:
            decision = dp.decide(model, request, 30.0, mode="cloud")
            if decision.choice is None:
                from shared.errors import ModelNotReady

                raise ModelNotReady(decision.reason)
            start = time.monotonic()
            return await dp._offload(
                model, request, decision.choice, None, start + 30.0, start, False, "deferred"
            )

        await self.deferrer.flush(send, can_send)

    # ---- Python API --------------------------------------------------------------
    async def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray] | list[Tensor],
        *,
        outputs: list[str] | None = None,
        deadline_ms: float | None = None,
        priority: int | None = None,
        deferrable: bool = False,
    ) -> InferResponse:
        tensors = (
            list(inputs)
            if isinstance(inputs, list)
            else [Tensor.from_array(name, array) for name, array in inputs.items()]
        )
        request = InferRequest(
            inputs=tensors, outputs=[RequestedOutput(n) for n in outputs] if outputs else None
        )
        return await self.dataplane.infer(
            model, request, deadline_ms=deadline_ms, priority=priority, deferrable=deferrable
        )

    def deferred_result(self, request_id: str) -> dict[str, Any]:
        return self.deferrer.result(request_id)

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        est = self.estimators
        return {
            "local_models": self.local.names(),
            "transports": {
                name: {
                    "connected": t.connected,
                    "breaker": self.dataplane.breakers[name].state,
                    "up_mbps": round(est.link(name).up_bps / 1e6, 3),
                    "down_mbps": round(est.link(name).down_bps / 1e6, 3),
                    "rtt_ms": round(est.link(name).rtt_s * 1000, 2),
                }
                for name, t in self.transports.items()
            },
            "local_latency_ms": {
                name: round((est.local(name).mean or 0) * 1000, 3) for name in self.local.names()
            },
            "deferred": self.store.counts(),
            "data_used_mb_today": round(self.dataplane.usage.today(), 3),
            "uptime_s": round(now - (self.started_at or now), 1),
            "where_options": [LOCAL, *(f"cloud-{t}" for t in self.transports)],
        }


def open_agent(path: Path) -> Agent:
    return Agent(load_agent_config(path))
