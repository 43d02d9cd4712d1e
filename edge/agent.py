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
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from devices.power import RaplReader, read_all, read_battery
from devices.profiles import LinkProfile, list_links, load_device, load_link
from edge.config import (
    RESTART_KEYS,
    AgentConfig,
    check_reachable,
    load_agent_config,
    unreachable_transports,
)
from edge.core import NATIVE, STALE_BUILD
from edge.core.breaker import CircuitBreaker
from edge.core.estimators import Estimators
from edge.core.policy import LOCAL, Policy
from edge.dataplane import EdgeDataPlane, cascade_output
from edge.deferred import Deferrer
from edge.local import LocalModels
from edge.store import DeferredStore
from edge.transports.base import Transport
from shared.errors import ConfigError, FerryError, InvalidInput, ModelNotFound, ShuttingDown
from shared.heap import trim_heap
from shared.messages import InferRequest, InferResponse, RequestedOutput
from shared.mqtt import BrokerAddress, parse_broker_url
from shared.pipeline import sample_inputs
from shared.repository import ModelRepository
from shared.tensors import Tensor
from shared.tls import client_tls_context

log = logging.getLogger(__name__)

#: seconds between tries of a config reload that failed while the file stays unchanged
RELOAD_RETRY_S = 10.0
#: seconds a local variant the config no longer names stays loaded (requests that
#: began before the reload may still run it), after which it is unloaded when idle
RETIRE_AFTER_S = 30.0
#: after a drain runs out, how long the requests still queued for a local run have to be
#: answered (they fail at once; the runs already under way end first)
STOP_QUEUED_S = 1.5

#: what POST /v2/agent/link may name: a profile of devices/links, not a path
_LINK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


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


def build_transports(config: AgentConfig) -> dict[str, Transport]:
    cloud = config.cloud
    transports: dict[str, Transport] = {}
    if cloud.mqtt_url:
        from edge.transports.mqtt import MqttTransport

        broker = parse_broker_url(cloud.mqtt_url)
        if cloud.mqtt_password is not None:
            broker = BrokerAddress(**{**asdict(broker), "password": cloud.mqtt_password})
        context = None
        if broker.tls:
            context = client_tls_context(
                cloud.ca_file,
                insecure=cloud.tls_insecure,
                cert_file=cloud.cert_file,
                key_file=cloud.key_file,
                section="cloud",
            )
        transports["mqtt"] = MqttTransport(
            broker,
            tls_context=context,
            client_id=cloud.mqtt_client_id,
            keepalive_s=cloud.mqtt_keepalive_s,
        )
    if cloud.http_url:
        from edge.transports.http import HttpTransport

        context = None
        if cloud.http_url.startswith("https://"):
            context = client_tls_context(
                cloud.ca_file,
                insecure=cloud.tls_insecure,
                cert_file=cloud.cert_file,
                key_file=cloud.key_file,
                section="cloud",
            )
        transports["http"] = HttpTransport(cloud.http_url, token=cloud.token, tls_context=context)
    return transports


class Agent:
    def __init__(self, config: AgentConfig, *, journal: int = 0) -> None:
        """``journal``: keep that many of the decision flow's events (and decisions) in
        memory, to replay them (:func:`edge.core.flow.replay_journal`); 0 keeps none."""
        self.config = config
        if not config.repository.is_dir():
            raise ConfigError(f"key 'repository': {config.repository} is not a folder")
        try:
            config.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file of that name, a read-only or virtual file system
            raise ConfigError(
                f"key 'state_dir': cannot use {config.state_dir} as the agent's state folder: "
                f"{exc.strerror or exc}"
            ) from None
        # one agent per state folder: two had shared the deferred store (both delivered
        # one row) and overwritten each other's estimates
        self._state_lock = _lock_state_dir(config.state_dir)
        try:
            self._build(config, journal)
        except BaseException:  # (the folder is free again for a corrected config)
            self._state_lock.close()
            raise

    def _build(self, config: AgentConfig, journal: int) -> None:
        self.state_file = config.state_dir / "estimates.json"
        self.estimators = Estimators.load(
            self.state_file, time.monotonic(), config.policy.deadline_quantile
        )
        self.device = load_device(config.device)
        self.transports = build_transports(config)
        self.links: dict[str, LinkProfile] = {}
        for t in self.transports:
            self._use_link(t, load_link(config.links[t]))
        self.local = LocalModels(
            ModelRepository(config.repository),
            config.local_threads,
            config.local_slowdown,
            config.local_latency_ms / 1000.0,
            inline_us=config.local_inline_us,
        )
        self.store = DeferredStore(
            config.state_dir / "deferred.db",
            max_rows=config.store.max_requests,
            max_bytes=config.store.max_bytes,
        )
        s = config.store
        self.deferrer = Deferrer(
            self.store, ttl_s=s.ttl_s, keep_results_s=s.keep_results_s, max_attempts=s.max_attempts
        )
        self.dataplane = EdgeDataPlane(
            policy=Policy(config.policy, self.estimators, self.device, self.links),
            estimators=self.estimators,
            local=self.local,
            transports=self.transports,
            breakers={t: CircuitBreaker() for t in self.transports},
            deferrer=self.deferrer,
            battery=Battery(),
            journal=journal,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._config_mtime = self._mtime()
        # (mtime, message, when) of the last reload that failed: tried again (see _watch_config)
        self._reload_failed: tuple[float, str, float] | None = None
        #: keys the config file changed that take effect only after a restart
        self.restart_pending: list[str] = []
        self._reloads: set[asyncio.Task[None]] = set()  # (SIGHUP's, held till done)
        self._retired: dict[str, float] = {}  # local model -> when the config let it go
        self._reloading = asyncio.Lock()
        self._rapl = RaplReader()
        self.started_at: float | None = None
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the one it started on
        self.ready = False
        self._stopping: asyncio.Future[None] | None = None

    def _use_link(self, transport: str, link: LinkProfile) -> None:
        self.links[transport] = link
        self.estimators.set_link_prior(
            transport, link.up_mbps * 1e6, link.down_mbps * 1e6, link.rtt_ms / 1000
        )

    # ---- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        """Load, connect and serve.  Once: a second call is a no-op while it runs (a
        second start had doubled the background loops, which then outlived stop), and
        a stopped agent does not start again (make a new one)."""
        if self._stopping is not None:
            raise ShuttingDown("this agent has stopped: an Agent runs once (make a new one)")
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        try:
            async with self._reloading:  # (a SIGHUP while starting waits for this)
                await self._load_local_models(self.config)
            for transport in self.transports.values():
                await transport.start()
        except BaseException:
            self._started = False  # (a start that failed may be tried again)
            raise
        self._tasks = [
            asyncio.create_task(
                self._every(lambda: self.config.probe_interval_s, self.dataplane.probe)
            ),
            asyncio.create_task(self._every(lambda: 1.0, self.flush_deferred)),
            asyncio.create_task(self._every(lambda: 10.0, self._save_estimates)),
            asyncio.create_task(self._every(lambda: 1.0, self._watch_config)),
        ]
        self.started_at = time.monotonic()
        self.dataplane.core.serving(self.started_at)
        self.ready = True
        if STALE_BUILD:
            # A build that no longer matches runs the (slower) Python sources: say so once.
            log.warning("decision core: %s", NATIVE)
        else:
            log.debug("decision core: %s", NATIVE)

    async def stop(self, drain_s: float = 10.0) -> None:
        """Stop taking requests, let the ones in flight finish (up to ``drain_s``: an
        offload waits on its transport, which closes after this), then close.

        A second call (a signal handler beside ``async with``) waits for the first.
        """
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(drain_s))
        await asyncio.shield(self._stopping)

    async def _stop(self, drain_s: float) -> None:
        try:
            await self._close(drain_s)
        finally:  # (however closing went: the state folder is free for the next agent)
            self._state_lock.close()

    async def _close(self, drain_s: float) -> None:
        self.ready = False
        if not await self.dataplane.drain(drain_s):
            # what waits for a local run is answered shutting_down now (the run under way
            # ends first), while the fronts are still open to write those answers
            log.warning(
                "stopping with requests still in flight after %g s: those still queued for a "
                "local run are answered shutting_down",
                drain_s,
            )
            self.local.stop_queued()
            await self.dataplane.drain(STOP_QUEUED_S)
        for task in (*self._tasks, *self._reloads):
            task.cancel()
        for task in (*self._tasks, *self._reloads):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        try:
            await self._save_estimates()
        except OSError as exc:
            log.error("estimates not saved to %s: %s", self.state_file, exc)
        finally:
            await self.dataplane.close()
            for transport in self.transports.values():
                await transport.close()
            # (joins the session threads, behind any queued runs: off the loop, which
            # the local API's drain still needs to write its answers)
            await asyncio.to_thread(self.local.close)
            await self.deferrer.close()

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
        cloud = self.config.cloud  # (the endpoints in force: [cloud] waits for a restart)
        endpoints = [t for t, url in (("http", cloud.http_url), ("mqtt", cloud.mqtt_url)) if url]
        for note in unreachable_transports(config.policy, endpoints):
            log.warning("%s: %s", config.source or "agent config", note)
        loaded = False
        for name in self._wanted_local(config):
            if self.local.has(name):
                continue
            loaded = True
            try:
                model = await asyncio.to_thread(self.local.load, name)
            except ModelNotFound as exc:  # a typo in the file: say where
                keys = [
                    f"models.{m}.local"
                    for m, mp in config.policy.models.items()
                    if mp.local_model == name
                ]
                where = f"{config.source or 'agent config'}: key {keys[0]!r}: " if keys else ""
                raise ConfigError(f"{where}{exc.message}") from None
            await self._warm_up(model.name)
        if loaded and not self.ready:  # what loading freed goes back to the system, at
            # start only: a trim holds the allocator's lock, which requests would wait on
            await asyncio.to_thread(trim_heap)
        for name, mp in config.policy.models.items():
            # (a name the model lacks failed every request with a 500 at run time, and
            # a default output that holds no scores failed every request with a 400)
            wanted = mp.cascade_output or mp.mode == "cascade"
            if wanted and mp.local_model and self.local.has(mp.local_model):
                local_config = self.local.get(mp.local_model).config
                declared = {t.name: t for t in local_config.outputs}
                outputs = sorted(declared)
                if mp.cascade_output and mp.cascade_output not in outputs:
                    raise ConfigError(
                        f"key 'models.{name}.cascade_output': local model {mp.local_model!r} "
                        f"has no output {mp.cascade_output!r}; its outputs are {outputs}"
                    )
                output = cascade_output(mp, local_config)
                kind = declared[output].datatype
                if kind in ("BYTES", "BOOL"):  # (a label: every request had failed, 400)
                    said = "" if mp.cascade_output else " (the default: its first output)"
                    raise ConfigError(
                        f"key 'models.{name}.cascade_output': output {output!r}{said} of "
                        f"{mp.local_model!r} is {kind}, not scores to read a confidence from"
                    )

    async def _warm_up(self, name: str) -> None:
        """Runs on zeros: one pays first-call costs, the next ``warm_up_runs`` seed the
        latency estimate where a cost is ever weighed (EdgeCore.latency_seeds; the
        replay seeds as many, edge/evaluation/ours.py)."""
        model = self.local.get(name)
        inputs = sample_inputs(model.session, model.config)
        core = self.dataplane.core
        try:
            await self.local.run(name, inputs)
            for _ in range(core.latency_seeds(self.config.policy.warm_up_runs)):
                _, seconds = await self.local.run(name, inputs)
                core.warmed(name, seconds, time.monotonic())
        except FerryError as exc:
            log.warning("warm-up of %s failed: %s", name, exc.message)

    async def _every(self, interval: Callable[[], float], fn: Any) -> None:
        name = getattr(fn, "__name__", fn)
        failing: str | None = None  # the last failure, said once until it changes
        while True:
            await asyncio.sleep(interval())
            try:
                await fn()
            except OSError as exc:  # a full or read-only disk: no traceback every turn
                if str(exc) != failing:
                    log.warning("background task %s failed: %s (retrying)", name, exc)
                failing = str(exc)
            except Exception as exc:  # a background task must never die
                if repr(exc) != failing:
                    log.exception("background task %s failed", name)
                failing = repr(exc)
            else:
                if failing is not None:
                    log.info("background task %s works again", name)
                failing = None

    async def _save_estimates(self) -> None:
        # Snapshot on the loop (the only writer), write and fsync off it.
        data = self.estimators.snapshot()
        await asyncio.to_thread(self.estimators.save, self.state_file, data)

    def _mtime(self) -> float | None:
        src = self.config.source
        try:
            return src.stat().st_mtime if src else None
        except OSError:
            return None

    async def _unload_retired(self) -> None:
        """Unload the local variants retired ``RETIRE_AFTER_S`` ago with no run under way
        (a request that began before the reload may still be on its way to one)."""
        now = time.monotonic()
        for name, since in list(self._retired.items()):
            if now - since < RETIRE_AFTER_S:
                continue
            model = self.local.take_back(name)  # on the loop: no run can start on it now
            if model is None:
                continue  # a run of it is under way: next time
            await asyncio.to_thread(model.close)
            del self._retired[name]
            log.info("local model %s unloaded: the config no longer names it", name)

    def reload_soon(self) -> None:
        """Re-read the config file now, changed or not (SIGHUP); not once stopping."""
        if self._stopping is not None:
            return
        log.info("SIGHUP: re-reading %s", self.config.source)
        task = asyncio.get_running_loop().create_task(self._watch_config(force=True))
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    async def _watch_config(self, force: bool = False) -> None:
        """Reload the config file when it changed (or ``force``: SIGHUP).

        A reload that failed is tried again every ``RELOAD_RETRY_S`` while the
        file stays as it is: the edit may be right and the world not yet (the
        model folder it names still being copied in, descriptors short for a
        moment), and it must not stay unapplied until the file is touched again.
        The same failure is logged once.  One reload at a time (a SIGHUP's beside the
        watcher's would load a model twice, or unload one twice)."""
        async with self._reloading:
            await self._reload(force)

    async def _reload(self, force: bool) -> None:
        await self._unload_retired()
        mtime = self._mtime()
        if mtime is None:
            if self._config_mtime is not None and self.config.source is not None:
                # (once: a deleted or unreadable file had said nothing at all)
                log.warning(
                    "agent config %s cannot be read: the running config stays in force",
                    self.config.source,
                )
                self._config_mtime = None
            return
        now = time.monotonic()
        failed = self._reload_failed
        if not force and mtime == self._config_mtime:
            if failed is None or failed[0] != mtime or now - failed[2] < RELOAD_RETRY_S:
                return
        assert self.config.source is not None
        try:
            new = load_agent_config(self.config.source)
            # The endpoints in force are the ones the agent started with ([cloud] waits
            # for a restart): a model the new file sends to a transport only its new
            # [cloud] names would be taken and never run (503 every time, "ready").
            check_reachable(new.policy, self.config.cloud, f"{new.source} (as running)")
            device = load_device(new.device)
            links = {t: load_link(new.links[t]) for t in self.transports}
            await self._load_local_models(new)
        except FerryError as exc:
            if failed is None or failed[:2] != (mtime, exc.message):
                log.error("agent config not reloaded, keeping the running one: %s", exc.message)
            self._config_mtime, self._reload_failed = mtime, (mtime, exc.message, now)
            return
        self._config_mtime, self._reload_failed = mtime, None
        self.apply(new, device, links)
        log.info("agent config reloaded from %s", new.source)

    def apply(self, new: AgentConfig, device: Any, links: dict[str, LinkProfile]) -> None:
        """Swap a validated configuration in; requests in flight keep their snapshot."""
        waiting = [k for k in RESTART_KEYS if getattr(new, k) != getattr(self.config, k)]
        self.restart_pending = waiting  # (status says it: the log line scrolls away)
        if waiting:
            log.warning("changed %s: takes effect after a restart", ", ".join(waiting))
            # what runs keeps its values until then (the next reload compares with them)
            new = replace(new, **{k: getattr(self.config, k) for k in waiting})
        self.device = device
        # The file's links changed (not a set_link): only the transports whose entry
        # changed restart; another transport keeps its live hint and its estimates.
        for t, link in links.items():
            if new.links.get(t) != self.config.links.get(t):
                self.estimators.reset_link(t)
                self._use_link(t, link)
        self.estimators.set_quantile(new.policy.deadline_quantile)
        self.local.slowdown = new.local_slowdown
        self.local.latency_floor_s = new.local_latency_ms / 1000.0
        s = new.store
        self.deferrer.ttl_s, self.deferrer.keep_results_s = s.ttl_s, s.keep_results_s
        self.deferrer.max_attempts = s.max_attempts
        self.store.max_rows, self.store.max_bytes = s.max_requests, s.max_bytes
        self.dataplane.policy = Policy(new.policy, self.estimators, self.device, self.links)
        self.config = new
        # Local variants the new config no longer names are unloaded once no request
        # can still be on its way to them (a remap kept every old one, ~90 MB each).
        wanted = set(self._wanted_local(new))
        now = time.monotonic()
        for name in self.local.names():
            if name not in wanted:
                self._retired.setdefault(name, now)
        for name in wanted:
            self._retired.pop(name, None)

    def set_link(self, transport: str, link: str, signal_dbm: float | None = None) -> LinkProfile:
        """The OS reported a network change (e.g. WiFi -> LTE) under ``transport``.

        The agent learns bandwidth from traffic, but the link's *kind* sets
        the radio's energy model and the priors, and the device knows it; a
        signal reading (dBm) scales the priors.  A new kind or a big move of
        the signal restarts the estimates (see ``EdgeCore.link_changed``).
        """
        if transport not in self.transports:
            raise InvalidInput(f"no transport {transport!r}; configured: {sorted(self.transports)}")
        if signal_dbm is not None and (
            isinstance(signal_dbm, bool)
            or not isinstance(signal_dbm, int | float | np.integer | np.floating)
            or not -150.0 <= signal_dbm <= 0.0
        ):
            raise InvalidInput(f"signal_dbm must be between -150 and 0 dBm, got {signal_dbm}")
        if not isinstance(link, str) or not _LINK_NAME.fullmatch(link):
            # a profile name (devices/links/*.toml), never a path a caller picks
            raise InvalidInput(
                f"link must be a link profile name such as 'wifi' or 'lte', got {link!r}"
            )
        if link not in list_links():  # (a file path's advice is not for this caller)
            raise InvalidInput(
                f"unknown link profile {link!r}: built-in ones are {', '.join(list_links())}"
            )
        try:
            profile = load_link(link)
        except ConfigError as exc:
            raise InvalidInput(exc.message) from None
        # link_changed compares with the link in use, then puts the new one in place
        # (self.links is the policy's own map).
        signal = float(signal_dbm) if signal_dbm is not None else None  # (numpy scalars too)
        self.dataplane.core.link_changed(transport, profile, time.monotonic(), signal)
        log.info(
            "transport %s now rides on link %s (signal %s dBm)", transport, profile.name, signal_dbm
        )
        return profile

    async def flush_deferred(self) -> None:
        dp = self.dataplane

        def can_send(model: str | None) -> bool:
            cloud = dp.core.policy.model_policy(model).cloud_model if model else None
            return any(dp.usable(time.monotonic(), cloud).values())

        await self.deferrer.flush(dp.send_deferred, can_send)

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
        idempotency_key: str | None = None,
    ) -> InferResponse:
        """``idempotency_key``: the app's retries of one request (same key, same inputs)
        are run once by the cloud and deferred once (the same receipt).  Call it on the
        loop the agent started on (from another thread: run_coroutine_threadsafe)."""
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            raise InvalidInput(
                "the agent runs on the event loop it was started on: from another loop or "
                "thread, use asyncio.run_coroutine_threadsafe(agent.infer(...), its loop)"
            )
        request = InferRequest(inputs=_tensors(inputs), outputs=_requested(outputs))
        if idempotency_key is not None:
            request.parameters["idempotency_key"] = idempotency_key
        return await self.dataplane.infer(
            model, request, deadline_ms=deadline_ms, priority=priority, deferrable=deferrable
        )

    # What the local V2 API serves, for Python callers too (the dataplane answers both).
    async def model_metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        return await self.dataplane.model_metadata(name, version)

    async def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        return await self.dataplane.model_config(name, version)

    async def model_ready(self, name: str, version: str | None = None) -> bool:
        return self.ready and await self.dataplane.ready(name, version)

    def repository_index(self) -> list[dict[str, str]]:
        return self.dataplane.repository_index()

    async def deferred_result(
        self, request_id: str, principal: str = "", allows: Callable[[str], bool] | None = None
    ) -> dict[str, Any]:
        """A deferral's status and answer, for the app that deferred it (``principal``,
        as :meth:`DataPlane.infer` was given it) with a token covering its model."""
        return await self.deferrer.result(request_id, principal, allows)

    async def status(self) -> dict[str, Any]:
        now = time.monotonic()
        est = self.estimators
        power = await asyncio.to_thread(read_all, self._rapl)
        return {
            "ready": self.ready,
            "device": self.device.name,
            "local_models": self.local.names(),
            "transports": {
                name: {
                    "connected": t.connected,
                    # (why not: a broker's refusal said; it had been a bare false)
                    **({"error": e} if (e := getattr(t, "last_error", None)) else {}),
                    "link": self.links[name].name,
                    "breaker": self.dataplane.breakers[name].state,
                    # what the policy believes now (old news faded into the long run)
                    "up_mbps": round(est.link(name).rates(now)[0] / 1e6, 3),
                    "down_mbps": round(est.link(name).rates(now)[1] / 1e6, 3),
                    "rtt_ms": round(est.link(name).rtt_at(now)[0] * 1000, 2),
                    # requests sent again: a node lost or rejoined, or one slow to answer
                    **({"resent": t.republished + t.hedged} if hasattr(t, "hedged") else {}),
                }
                for name, t in self.transports.items()
            },
            "local_latency_ms": {
                name: round((est.local(name).mean or 0) * 1000, 3) for name in self.local.names()
            },
            # what is under way now: requests taken and not answered, local runs queued
            "inflight": self.dataplane.inflight,
            "local_backlog": {name: self.local.backlog(name) for name in self.local.names()},
            "deferred": await self.deferrer.counts(),
            "data_used_mb_today": round(self.dataplane.usage.today(), 3),
            "power": [{k: v for k, v in asdict(r).items() if v not in (None, "")} for r in power],
            "uptime_s": round(now - (self.started_at or now), 1),
            # edited in the config file, waiting for a restart (RESTART_KEYS)
            **({"restart_pending": self.restart_pending} if self.restart_pending else {}),
            "where_options": [LOCAL, *(f"cloud-{t}" for t in self.transports)],
        }


def _lock_state_dir(state_dir: Path) -> Any:
    """An open file holding an exclusive lock on ``state_dir`` (released when closed, or
    when the process ends however it ends); ConfigError while another agent holds it."""
    path = state_dir / "agent.lock"
    try:
        handle = open(path, "a+")
    except OSError as exc:
        raise ConfigError(f"key 'state_dir': cannot open {path}: {exc.strerror}") from None
    try:
        import fcntl

        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # (no flock on this system: one agent per folder is on trust)
        return handle
    except OSError:
        handle.seek(0)
        holder = handle.read().strip()
        handle.close()
        raise ConfigError(
            f"key 'state_dir': {state_dir} is in use by another agent"
            + (f" (pid {holder})" if holder else "")
            + ": give each agent a state folder of its own"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def _tensors(inputs: object) -> list[Tensor]:
    """An app's inputs as tensors: a mapping of names to arrays (or what numpy makes
    arrays of), or a list of Tensors; anything else an InvalidInput, not a TypeError."""
    if isinstance(inputs, list) and all(isinstance(t, Tensor) for t in inputs):
        return list(inputs)
    if not isinstance(inputs, Mapping):
        raise InvalidInput(
            "inputs must be a mapping of input names to arrays (or a list of Tensors), "
            f"got {type(inputs).__name__}"
        )
    tensors = []
    for name, array in inputs.items():
        if array is None:
            raise InvalidInput(f"input {name!r}: no data (None)")
        try:
            tensors.append(Tensor.from_array(name, array))
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"input {name!r}: not an array of one datatype: {exc}") from None
    return tensors


def _requested(outputs: object) -> list[RequestedOutput] | None:
    if not outputs:
        return None
    if isinstance(outputs, str):  # (iterated, its characters were asked for)
        outputs = [outputs]
    if not isinstance(outputs, list | tuple) or not all(isinstance(n, str) for n in outputs):
        raise InvalidInput(f"outputs must be a list of output names, got {outputs!r}")
    return [RequestedOutput(n) for n in outputs]


def open_agent(path: Path) -> Agent:
    return Agent(load_agent_config(path))
