"""The cloud tier's one dataplane, shared by the HTTP and MQTT fronts.

It owns the model registry (load, unload, versions), validates requests
against each model's configuration, hands them to the model's dynamic
batcher and shapes the answer.  Fronts only decode, call :meth:`infer` and
encode, so both transports give the same results and the same errors.

Invariant: a name in ``self._models`` always maps to started batchers; a
reload builds the new versions fully before swapping them in, then drains
the old ones, so requests in flight are never dropped.  Loads are built one
at a time (a node-wide lock) so memory readings and thread budgets of two
loads never mix (see :mod:`cloud.loading`).

Every request that reaches a model is counted in its statistics, including
those refused by validation before the batcher (reason ``OTHER``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from cloud.batcher import DynamicBatcher
from cloud.loading import (
    LONE_MAX_SHARED_RUN_S,
    LONE_MIN_RUN_S,
    MemoryProbe,
    batch1_run_s,
    outputs_follow_batch,
    planned_sessions,
    session_threads,
    warm_up,
)
from cloud.stats import OTHER, ModelStats
from cloud.workers import NodeActivity
from shared import v2
from shared.aio.idempotency import (
    IdempotencyCache,
    as_duplicate,
    owned_response,
    response_bytes,
)
from shared.errors import (
    DeadlineExceeded,
    FerryError,
    ModelNotFound,
    ModelNotReady,
    ShuttingDown,
)
from shared.idempotency import fingerprint, idempotency_key, scoped_key
from shared.messages import InferRequest, InferResponse
from shared.pipeline import open_session
from shared.pipeline.classification import requested_classes, top_k
from shared.repository import (
    ModelConfig,
    ModelRepository,
    complete_config,
    parse_version,
    triton_model_config,
    v2_model_metadata,
    validate_model_name,
)
from shared.repository.capacity import (
    NodeCapacity,
    available_memory,
    check_capacity,
    model_file_bytes,
)
from shared.repository.validation import output_tensor, validated_inputs, validated_outputs
from shared.runtimes import Session
from shared.runtimes.base import available_cpus
from shared.tensors import Limits, Tensor

log = logging.getLogger(__name__)


#: backends whose sessions take an intra-op thread count (a lone session helps them)
_THREADED_BACKENDS = ("onnxruntime", "openvino")


@dataclass
class LoadedModel:
    name: str
    version: int
    config: ModelConfig
    sessions: list[Session]
    batcher: DynamicBatcher
    stats: ModelStats
    loaded_at: float = field(default_factory=time.monotonic)
    #: a session with a thread per core for lone requests on an idle node (cloud.batcher)
    lone: Session | None = None

    def all_sessions(self) -> list[Session]:
        return [*self.sessions, self.lone] if self.lone is not None else list(self.sessions)


def with_timeout(params: dict[str, Any], start: float, deadline: float | None) -> float | None:
    """``deadline`` tightened by the request's V2 ``timeout`` (microseconds from
    ``start``; 0: none), which is checked."""
    timeout_us = params.get("timeout")
    if timeout_us is None:
        return deadline
    if not v2.checked_timeout_us(timeout_us):
        return deadline
    until = start + timeout_us / 1e6
    return until if deadline is None else min(deadline, until)


class DataPlane:
    def __init__(
        self,
        repository: ModelRepository,
        node: str,
        *,
        default_max_queue: int = 0,
        strict_readiness: bool = True,
        idempotency_ttl_s: float = 600.0,
        idempotency_max_entries: int = 4096,
        idempotency_max_bytes: int = 64 << 20,
        cores: int | None = None,
        max_elements: int = Limits.max_elements,
        inline_run_us: float = 0.0,
        turns: bool = False,
    ) -> None:
        self.repository = repository
        self.node = node
        self.default_max_queue = default_max_queue
        self.strict_readiness = strict_readiness
        self.idempotency_ttl_s = idempotency_ttl_s
        self.idempotency_max_entries = idempotency_max_entries
        self.cores = cores or available_cpus()
        self.max_elements = max_elements
        self.inline_run_us = inline_run_us
        # batches running, all models together; with turns, one at a time
        self.activity = NodeActivity(turns)
        self._models: dict[str, dict[int, LoadedModel]] = {}
        self._failed: dict[str, str] = {}
        self._loading: set[str] = set()  # loads under way (LOADING in the index)
        self._locks: dict[str, asyncio.Lock] = {}
        #: each model's files as its last load attempt found them (what a rescan compares)
        self._marks: dict[str, tuple[Any, ...]] = {}
        self._build_lock = threading.Lock()  # node-wide: one load at a time
        self._memory = MemoryProbe()
        self._planned_sessions = 0
        self._idempotency: IdempotencyCache[InferResponse] = IdempotencyCache(
            idempotency_ttl_s,
            idempotency_max_entries,
            idempotency_max_bytes,
            response_bytes,
            owned_response,
        )
        self._closing = False
        # leaving the fleet (a SIGTERM in fleet mode): still serving, reported as closing
        # so the controller re-homes its models, not ready for new traffic
        self.leaving = False
        self._started = time.monotonic()
        self._boot = uuid.uuid4().hex[:12]  # (fleet views tell a restart by it, not by uptime)
        self._busy_mark: tuple[float, int] = (self._started, 0)
        # (model, version) -> (when, requests then, rate): each status says its own rate,
        # so one report is enough to read it (ferry-cloud fleet); bounded by the models
        self._rate_marks: dict[tuple[str, str], tuple[float, int, float]] = {}
        self.on_models_changed: list[Any] = []
        #: callables adding keys to :meth:`status` (capacity, placement followed, ...)
        self.status_extras: list[Any] = []
        # more conditions of readiness (a fleet node: it holds its share of the placement)
        self.readiness_gates: list[Callable[[], bool]] = []
        #: where requests for models this node does not host go (None: nowhere)
        self.remote: RemoteModels | None = None

    # ---- registry -------------------------------------------------------------
    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def plan(self, names: Iterable[str]) -> int:
        """Count the sessions a start-up set will load, so early loads share the cores too."""
        total = 0
        for name in names:
            try:
                config = self.repository.read_config(name)
                versions = self.repository.selected_versions(name, config)
            except FerryError:
                continue  # its load will report the error
            total += planned_sessions(config, len(versions))
        self._planned_sessions = total
        return total

    def end_plan(self) -> None:
        self._planned_sessions = 0

    def mark_failed(self, name: str, reason: str) -> None:
        """Record a requested model that could not load (strict readiness counts it)."""
        self._failed.setdefault(name, reason)

    async def load(self, name: str, config: ModelConfig | None = None) -> None:
        """Load (or hot-reload) every selected version of ``name``.

        ``config`` overrides the repository's configuration for this load
        (Triton's load parameter ``config``); a later load without it reads
        the repository again.
        """
        validate_model_name(name)
        if self._closing:
            raise ShuttingDown("server is shutting down")
        # ModelNotFound before anything is built, or a lock kept (each junk name a lock)
        self.repository.model_dir(name)
        async with self._lock(name):
            self.repository.model_dir(name)  # (gone while it waited its turn)
            loop = asyncio.get_running_loop()
            # A failed hot reload leaves the versions already serving in place (and the
            # node ready); only a model with nothing loaded is marked failed.
            serving = name in self._models
            self._loading.add(name)
            try:
                self._marks[name] = await loop.run_in_executor(
                    None, self.repository.fingerprint, name
                )
                built = await loop.run_in_executor(None, self._build, name, config)
            except FerryError as exc:
                if not serving:
                    self._failed[name] = exc.message
                # (said only to the caller of the API, a failed rollout left no trace)
                log.error("failed to load %s: %s%s", name, exc.message, _kept(serving))
                raise
            except Exception as exc:  # a runtime's own failure
                if not serving:
                    self._failed[name] = str(exc)
                log.error("failed to load %s: %s%s", name, exc, _kept(serving))
                raise ModelNotReady(f"model {name!r} failed to load: {exc}") from exc
            finally:
                self._loading.discard(name)
            for model in built.values():
                await model.batcher.start()
            old = self._models.get(name, {})
            self._models[name] = built
            self._failed.pop(name, None)
            log.info("loaded %s versions %s", name, sorted(built))
            self._changed()
            await self._retire(old.values())

    def _other_sessions(self, name: str) -> int:
        """Sessions loaded for other models (read from a worker thread: snapshot first)."""
        snapshot = list(self._models.items())
        return sum(len(m.sessions) for other, vs in snapshot if other != name for m in vs.values())

    def _build(self, name: str, override: ModelConfig | None) -> dict[int, LoadedModel]:
        """Create sessions off the event loop (loading a model blocks for a while)."""
        with self._build_lock:
            other_sessions = self._other_sessions(name)
            config = override if override is not None else self.repository.read_config(name)
            versions = self.repository.selected_versions(name, config)
            if not versions:
                why = self.repository.no_versions_why(name)
                raise ModelNotFound(f"model {name!r} cannot load: {why}")
            _, newest = self.repository.model_file(name, versions[-1], config.backend)
            check_capacity(
                config,
                NodeCapacity(self.cores, available_memory(), self.max_elements),
                str(config.source) if config.source else "load request: parameter 'config'",
                versions=len(versions),
                model_bytes=model_file_bytes(newest),
            )
            own = planned_sessions(config, len(versions))
            # taking turns, a batch has the node's cores to itself: a thread per core
            sharing = (
                1 if self.activity.turns else max(other_sessions + own, self._planned_sessions)
            )
            threads = session_threads(config, self.cores, sharing)
            options = replace(
                config.runtime.to_options(device=config.instance_group.kind), threads=threads
            )
            built: dict[int, LoadedModel] = {}
            try:
                for version in versions:
                    built[version] = self._build_version(name, version, config, options)
            except BaseException:
                for model in built.values():
                    for session in model.all_sessions():
                        session.close()
                raise
            return built

    def _build_version(
        self, name: str, version: int, config: ModelConfig, options: Any
    ) -> LoadedModel:
        before = self._memory.read()
        backend, path = self.repository.model_file(name, version, config.backend)
        sessions = [open_session(backend, path, options, config)]
        lone: Session | None = None
        try:
            vconfig = complete_config(config, sessions[0])
            for _ in range(vconfig.instance_group.count - 1):
                sessions.append(open_session(backend, path, options, config))
            lone_threads = self._lone_threads(vconfig, backend, options.threads, sessions[0])
            if lone_threads:
                # It runs only while nothing else runs on the node, so its threads may
                # spin between the parallel sections of a run: measured here, a batch-1
                # call after an idle gap took 3.7 ms without spinning and 2.1 ms with.
                lone_options = replace(options, threads=lone_threads, allow_spinning=True)
                lone = open_session(backend, path, lone_options, config)
            for session in [*sessions, lone] if lone is not None else sessions:
                warm_up(session, vconfig)
            merge = True
            if vconfig.dynamic_batching is not None and (vconfig.max_batch_size or 0) >= 2:
                if outputs_follow_batch(sessions[0], vconfig) is False:
                    merge = False
                    log.warning(
                        "model %s version %s: a two-item batch's outputs do not have 2 as "
                        "their first dimension, so the batch cannot be cut back per request; "
                        "its requests run alone (declare max_batch_size = 0 if the first "
                        "dimension is not a batch)",
                        name,
                        version,
                    )
        except BaseException:
            for session in [*sessions, lone] if lone is not None else sessions:
                session.close()
            raise
        # A reload of a version that serves keeps its statistics: its counters (Prometheus
        # and the statistics extension) go on, never back, and the old instances' last
        # requests are counted in them too.
        serving = self._models.get(name, {}).get(version)
        stats = serving.stats if serving is not None else ModelStats(name, version)
        stats.memory_bytes = MemoryProbe.growth(before, self._memory.read())
        batcher = DynamicBatcher(
            model=name,
            version=version,
            sessions=sessions,
            max_batch_size=vconfig.max_batch_size or 0,
            policy=vconfig.dynamic_batching,
            stats=stats,
            default_max_queue=self.default_max_queue,
            inline_us=self.inline_run_us,
            lone=lone,
            activity=self.activity,
            oversize_alone=vconfig.max_batch_size_inferred,
            merge=merge,
        )
        log.info(
            "model %s version %s: %d session(s) x %d thread(s)%s, ~%d KiB",
            name,
            version,
            len(sessions),
            options.threads,
            f" + a lone-request session x {lone_threads}" if lone is not None else "",
            (stats.memory_bytes or 0) // 1024,
        )
        return LoadedModel(name, version, vconfig, sessions, batcher, stats, lone=lone)

    def _lone_threads(
        self, config: ModelConfig, backend: str, threads: int | None, instance: Session
    ) -> int:
        """Threads of the lone-request session (0: none).  As configured; by default the
        node's cores, for CPU backends whose instances have fewer, and models whose
        batch-1 run is long enough for more threads to pay (LONE_MIN_RUN_S)."""
        wanted = config.runtime.lone_threads
        if wanted is None:
            cpu = config.instance_group.kind == "cpu" and backend in _THREADED_BACKENDS
            wanted = self.cores if cpu else 0
            if wanted > (threads or self.cores):
                warm_up(instance, config)
                run_s = batch1_run_s(instance, config)
                if run_s < LONE_MIN_RUN_S:
                    wanted = 0
                elif config.instance_group.count > 1 and run_s > LONE_MAX_SHARED_RUN_S:
                    # the lone run holds every instance: beside several, a second
                    # request waited out a long first run while one sat idle
                    wanted = 0
        return wanted if wanted > (threads or self.cores) else 0

    async def unload(self, name: str) -> None:
        """Unload ``name``; unloading a model whose load failed clears the failure."""
        validate_model_name(name)
        if name not in self._locks and name not in self._models and name not in self._failed:
            raise ModelNotFound(f"model {name!r} is not loaded")  # (no lock kept for it)
        async with self._lock(name):
            old = self._models.pop(name, None)
            self._idempotency.forget(lambda key: key[0] != name)
            if old is None:
                if self._failed.pop(name, None) is not None:
                    return
                raise ModelNotFound(f"model {name!r} is not loaded")
            self._changed()
            await self._retire(old.values())

    async def rescan(self, every_model: bool) -> dict[str, list[str]]:
        """Read the repository again, as Triton's poll mode does, on demand: a model
        whose files changed is reloaded, a failed one tried again (what failed it may
        have been fixed outside its files), one whose folder is gone unloaded, and with
        ``every_model`` a new folder loaded; a model serving from unchanged files is
        left alone (a rescan never reloads for nothing)."""
        loop = asyncio.get_running_loop()
        names, marks = await loop.run_in_executor(None, self._scan)
        done: dict[str, list[str]] = {"loaded": [], "reloaded": [], "unloaded": [], "failed": []}
        for name in sorted((set(self._models) | set(self._failed)) - set(names)):
            with contextlib.suppress(FerryError):  # (unloaded meanwhile)
                await self.unload(name)
                done["unloaded"].append(name)
            self._marks.pop(name, None)
        for name in names:
            loaded = name in self._models
            if not (loaded or every_model or name in self._failed):
                continue
            if self._marks.get(name) == marks[name] and name not in self._failed:
                continue  # (a failed one is tried again: the fix may be outside its files)
            try:
                await self.load(name)
            except FerryError as exc:
                done["failed"].append(f"{name}: {exc.message}")
            else:
                done["reloaded" if loaded else "loaded"].append(name)
        return done

    def _scan(self) -> tuple[list[str], dict[str, tuple[Any, ...] | None]]:
        names = self.repository.model_names()
        marks: dict[str, tuple[Any, ...] | None] = {}
        for name in names:
            try:
                marks[name] = self.repository.fingerprint(name)
            except (FerryError, OSError):
                marks[name] = None  # (its load will say why)
        return names, marks

    async def _retire(self, models: Iterable[LoadedModel]) -> None:
        for model in models:
            await model.batcher.stop(drain=True)
            for session in model.all_sessions():
                session.close()

    def _changed(self) -> None:
        for callback in list(self.on_models_changed):
            callback()

    def begin_shutdown(self) -> None:
        """Refuse new requests from now on (readiness turns false); queued work goes on."""
        self._closing = True

    @property
    def closing(self) -> bool:
        return self._closing

    async def close(self) -> None:
        """Stop accepting, finish queued work, close every runtime."""
        self._closing = True
        names = list(self._models)
        for name in names:
            old = self._models.pop(name, {})
            await self._retire(old.values())
        self._changed()

    # ---- lookups -------------------------------------------------------------
    def loads_under_way(self) -> bool:
        """A runtime is building a session now (in a worker thread, whose caller may be
        gone: a cancelled load's build runs on to its end)."""
        return self._build_lock.locked()

    def loaded_names(self) -> list[str]:
        return sorted(self._models)

    def is_ready(self) -> bool:
        """Serving, (strict readiness) no requested model failed to load, and every
        gate open."""
        if self._closing or self.leaving or (self.strict_readiness and self._failed):
            return False
        return all(gate() for gate in self.readiness_gates)

    def failed_models(self) -> dict[str, str]:
        return dict(self._failed)

    def get(self, name: str, version: str | int | None = None) -> LoadedModel:
        versions = self._models.get(name)
        if not versions:
            if name in self._failed:
                raise ModelNotReady(f"model {name!r} is not ready: {self._failed[name]}")
            if name in self._loading:  # (a 404 "unknown" read as for good to clients)
                raise ModelNotReady(f"model {name!r} is loading", retry_after=1.0)
            raise ModelNotFound(f"unknown model {name!r}")
        if version in (None, ""):
            return versions[max(versions)]
        number = parse_version(version)
        model = versions.get(number)
        if model is None:
            raise ModelNotFound(f"model {name!r} has no loaded version {number}")
        return model

    def _remote_for(self, name: str, version: str | int | None) -> RemoteModels | None:
        """The fleet, when it serves ``name`` and this node does not (any version is
        looked up where the model runs)."""
        if name in self._models or self.remote is None:
            return None
        remote = self.remote
        return remote if remote.hosted(name) or remote.placed(name) else None

    def check_servable(self, name: str, version: str | int | None = None) -> None:
        """Raise unless a request for ``name`` can be served here or by the fleet
        (fronts call it before reading or decoding a body)."""
        if self._remote_for(name, version) is not None:
            return
        try:
            self.get(name, version)
        except ModelNotFound:
            if self.remote is not None and self._in_repository(name):
                # demand the controller may place; a name the repository lacks is not
                # (junk names had filled the table and every node's status for good)
                self.remote.missed(name)
            if self.remote is not None:
                why = None
                if name not in self._models and not self.remote.placed(name):
                    why = self.remote.unplaced(name)  # (partly placed ones are listed too)
                if why is not None:  # in the repository, on no node: not "unknown"
                    raise ModelNotReady(
                        f"model {name!r} is placed on no node at the moment: {why}"
                    ) from None
            raise

    def _in_repository(self, name: str) -> bool:
        try:
            self.repository.model_dir(name)
        except FerryError:
            return False
        return True

    def model_ready(self, name: str, version: str | None = None) -> bool:
        if self._closing:
            return False
        if self._remote_for(name, version) is not None:
            return self.remote is not None and self.remote.hosted(name)
        try:
            self.get(name, version)
        except FerryError:
            return False
        return True

    def metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        remote = self._remote_for(name, version)
        if remote is not None:
            return remote.metadata(name)
        model = self.get(name, version)
        versions = [str(v) for v in sorted(self._models[name])]
        return v2_model_metadata(name, model.config, versions)

    def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        remote = self._remote_for(name, version)
        if remote is not None:
            return remote.config(name)
        doc = triton_model_config(self.get(name, version).config)
        policy = doc.get("dynamic_batching", {}).get("default_queue_policy")
        if policy is not None and not policy["max_queue_size"] and self.default_max_queue:
            # the bound this node applies (its [limits] default), not Triton's 0 (unbounded)
            policy["max_queue_size"] = self.default_max_queue
        return doc

    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Triton's repository index: each version on disk with its state, and each one
        serving whose files are gone (it had been left out while it answered)."""
        entries = []
        listed: set[tuple[str, int]] = set()
        for entry in self.repository.index():
            name = entry["name"]
            loaded = self._models.get(name, {})
            version = entry.get("version")
            if version is not None and str(version).isdigit() and int(version) in loaded:
                entry = {**entry, "state": "READY", "reason": ""}
                listed.add((name, int(version)))
            elif name in self._failed:
                entry = {**entry, "reason": self._failed[name]}
            elif name in self._loading:
                entry = {**entry, "state": "LOADING"}
            if not ready_only or entry["state"] == "READY":
                entries.append(entry)
        for name, versions in sorted(self._models.items()):
            gone = sorted(set(versions) - {v for n, v in listed if n == name})
            if gone:  # (not also "no version folder holds a model file" beside them)
                entries = [e for e in entries if not (e["name"] == name and e["version"] == "")]
            for number in gone:
                entries.append(
                    {
                        "name": name,
                        "version": str(number),
                        "state": "READY",
                        "reason": "serving; its files are no longer in the repository",
                    }
                )
        return entries

    def all_stats(self) -> list[ModelStats]:
        return [m.stats for versions in self._models.values() for m in versions.values()]

    def statistics(self, name: str | None = None, version: str | None = None) -> dict[str, Any]:
        if name is None:
            return {"model_stats": [s.to_triton() for s in self.all_stats()]}
        if version:
            return {"model_stats": [self.get(name, version).stats.to_triton()]}
        self.get(name)
        return {"model_stats": [m.stats.to_triton() for m in self._models[name].values()]}

    def status(self) -> dict[str, Any]:
        """Node status for the retained MQTT topic and for placement."""
        now = time.monotonic()
        compute_ns = 0
        sessions = 0
        models = []
        depth = 0
        marks: dict[tuple[str, str], tuple[float, int, float]] = {}
        for versions in self._models.values():
            for m in versions.values():
                snap = m.stats.snapshot()
                requests = snap.success_count + snap.fail_count
                key = (m.name, str(m.version))
                since, before, rate = self._rate_marks.get(key, (self._started, 0, 0.0))
                if now - since >= 1.0:  # (a status sent on an event: keep the last rate)
                    rate = max(0, requests - before) / (now - since)
                    since, before = now, requests
                marks[key] = (since, before, rate)
                compute_ns += snap.compute_infer_ns
                sessions += len(m.sessions)
                depth += m.batcher.queue_depth
                models.append(
                    {
                        "name": m.name,
                        "version": str(m.version),
                        "backend": m.config.backend,
                        "queue_depth": m.batcher.queue_depth,
                        "instances": len(m.sessions),
                        "memory_bytes": snap.memory_bytes,
                        # cumulative: readers turn two reports into a rate
                        "requests": requests,
                        "rate": round(rate, 3),  # req/s since the last status
                        "executions": snap.execution_count,
                        "compute_ns": snap.compute_infer_ns,
                    }
                )
        mark_time, mark_ns = self._busy_mark
        elapsed = max(now - mark_time, 1e-9)
        utilisation = min(1.0, (compute_ns - mark_ns) / 1e9 / elapsed / max(sessions, 1))
        self._busy_mark = (now, compute_ns)
        self._rate_marks = marks  # (unloaded models leave)
        status = {
            "node": self.node,
            "state": "closing" if self._closing or self.leaving else "online",
            "models": models,
            "queue_depth": depth,
            "utilisation": round(max(utilisation, 0.0), 4),
            "uptime_s": round(now - self._started, 3),
            "boot": self._boot,
        }
        for extra in self.status_extras:
            status.update(extra())
        return status

    def describe_loaded(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """V2 metadata and Triton config of every loaded model (newest version), so
        other nodes can answer for a model they do not host."""
        metadata = {name: self.metadata(name) for name in self._models}
        configs = {name: self.model_config(name) for name in self._models}
        return metadata, configs

    def retry_hint(self, name: str | None) -> float | None:
        """Seconds a refused client of ``name`` should wait (from any thread; None: unknown)."""
        versions = self._models.get(name) if name else None
        if not versions:
            return None
        return max(m.batcher.retry_hint() for m in list(versions.values()))

    # ---- inference ------------------------------------------------------------
    async def infer(
        self,
        name: str,
        request: InferRequest,
        *,
        version: str | None = None,
        deadline: float | None = None,
        principal: str = "",
        forwardable: bool = True,
    ) -> InferResponse:
        """Run one request; ``principal`` (who sent it) scopes its idempotency key.

        A request for a model hosted elsewhere in the fleet is forwarded over the
        broker (once: ``forwardable`` is False for a request that was forwarded
        already, so two nodes with stale views cannot bounce it between them)."""
        start = time.monotonic()
        if self._closing:
            raise ShuttingDown("node is shutting down")
        wanted = version or request.model_version
        remote = self._remote_for(name, wanted)
        if remote is not None:
            if not forwardable:
                raise ModelNotReady(
                    f"model {name!r} moved away from node {self.node}; try again",
                    retry_after=0.05,
                )
            # the caller's V2 timeout bounds the wait for a home and the forward too
            deadline = with_timeout(request.parameters, start, deadline)
            # placed but between homes (its node died, its new one is loading it): wait
            # for a node to serve it, here or elsewhere, within the deadline
            give_up = start + remote.handover_wait_s
            while not remote.hosted(name) and name not in self._models:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise DeadlineExceeded(
                        f"model {name!r} found no node to serve it within the deadline"
                    )
                if now >= give_up or not remote.placed(name):
                    raise ModelNotReady(
                        f"model {name!r} is being moved between nodes; try again",
                        retry_after=1.0,
                    )
                await asyncio.sleep(0.05)
            if name not in self._models:
                key = idempotency_key(request.parameters)
                if principal and key is not None:
                    # The host scopes keys by who sent them there: this node.  Its
                    # senders' keys are kept apart here (two tokens' "order-1" had met at
                    # the host: one got the other's answer, or its 409).  (A null key is
                    # no key: scoped, every such request had been one retry of the first.)
                    scoped = scoped_key(principal, key)
                    request = replace(
                        request, parameters={**request.parameters, "idempotency_key": scoped}
                    )
                return await remote.infer(name, request, version=wanted, deadline=deadline)
        if not forwardable and name not in self._models and self.remote is not None:
            raise ModelNotReady(
                f"model {name!r} is not hosted on node {self.node} (placement changing)",
                retry_after=0.05,
            )
        model = self.get(name, wanted)
        try:
            inputs = validated_inputs(model.config, request)
            outputs = validated_outputs(model.config, request)
            classes = requested_classes(model.config, request)
            params = request.parameters
            priority = params.get("priority")
            if priority is not None:
                v2.checked_priority(priority)
            deadline = with_timeout(params, start, deadline)
            key = idempotency_key(params) if "idempotency_key" in params else None
        except FerryError:
            model.stats.record_failure(int((time.monotonic() - start) * 1e9), OTHER)
            raise
        run = _Run(model, request.id, inputs, outputs, classes, deadline, priority or None)
        if key is None:
            return await self._execute(run)
        response, duplicate = await self._idempotency.run(
            (name, principal, key),
            lambda: self._execute(run),
            # the version asked for, not the one that served: a retry across a rollout
            # of a new version is the same request (it had been a 409 "other inputs",
            # and a deferred request resent by its agent failed for good)
            fingerprint(request, parse_version(wanted) if wanted else -1),
            deadline=deadline,  # (a retry joining a run waits within its own deadline)
        )
        if not duplicate:
            return response
        model.stats.record_duplicate()
        answer = as_duplicate(response)
        answer.id = request.id
        return answer

    async def _execute(self, run: _Run) -> InferResponse:
        model = run.model
        try:
            result = await model.batcher.infer(
                run.inputs, run.outputs, deadline=run.deadline, priority=run.priority
            )
        except ModelNotReady:
            # Swapped by a hot reload between lookup and queueing: the new one serves it.
            current = self._models.get(model.name, {}).get(model.version)
            if current is None or current is model or self._closing:
                raise
            model = current
            result = await model.batcher.infer(
                run.inputs, run.outputs, deadline=run.deadline, priority=run.priority
            )
        config = model.config
        names = run.outputs or [t.name for t in config.outputs] or list(result.outputs)
        tensors = []
        for n in names:
            if run.classes and n in run.classes:
                labels = getattr(model.sessions[0], "labels", {}).get(n)
                strings = top_k(
                    result.outputs[n], run.classes[n], bool(config.max_batch_size), labels
                )
                tensors.append(Tensor(n, "BYTES", strings))
            else:
                tensors.append(output_tensor(n, result.outputs[n], config))
        return InferResponse(
            model_name=model.name,
            model_version=str(model.version),
            id=run.request_id,
            outputs=tensors,
            parameters={
                "queue_us": result.queue_us,
                "compute_us": result.compute_us,
                "batch_size": result.batch_size,
                "node": self.node,
            },
        )


class RemoteModels(Protocol):
    """The rest of the fleet, as the dataplane sees it (see :mod:`cloud.fleet`)."""

    #: how long a request waits for a placed model that no node serves at the moment
    handover_wait_s: float

    def hosted(self, name: str) -> bool: ...

    def placed(self, name: str) -> bool: ...

    def missed(self, name: str) -> None: ...

    def unplaced(self, name: str) -> str | None: ...

    def metadata(self, name: str) -> dict[str, Any]: ...

    def config(self, name: str) -> dict[str, Any]: ...

    async def infer(
        self, name: str, request: InferRequest, *, version: str | None, deadline: float | None
    ) -> InferResponse: ...


@dataclass(slots=True)
class _Run:
    """A validated request, ready for the batcher (or for the idempotency cache)."""

    model: LoadedModel
    request_id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[str] | None
    classes: dict[str, int] | None
    deadline: float | None
    priority: int | None


def _kept(serving: bool) -> str:
    return " (the versions loaded before keep serving)" if serving else ""
