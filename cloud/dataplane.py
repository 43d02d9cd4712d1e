"""The cloud tier's one dataplane, shared by the HTTP and MQTT fronts.

It owns the model registry (load, unload, versions), validates requests
against each model's configuration, hands them to the model's dynamic
batcher and shapes the answer.  Fronts only decode, call :meth:`infer` and
encode, so both transports give the same results and the same errors.

Invariant: a name in ``self._models`` always maps to started batchers; a
reload builds the new versions fully before swapping them in, then drains
the old ones, so requests in flight are never dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cloud.batcher import DynamicBatcher
from cloud.stats import ModelStats
from shared.errors import FerryError, InvalidInput, ModelNotFound, ModelNotReady
from shared.messages import InferRequest, InferResponse
from shared.repository import (
    ModelConfig,
    ModelRepository,
    complete_config,
    triton_model_config,
    validate_model_name,
)
from shared.runtimes import Session, load_session
from shared.tensors import Tensor

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    version: int
    config: ModelConfig
    sessions: list[Session]
    batcher: DynamicBatcher
    stats: ModelStats
    loaded_at: float = field(default_factory=time.monotonic)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class DataPlane:
    def __init__(self, repository: ModelRepository, node: str) -> None:
        self.repository = repository
        self.node = node
        self._models: dict[str, dict[int, LoadedModel]] = {}
        self._failed: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._closing = False
        self._started = time.monotonic()
        self._busy_mark: tuple[float, int] = (self._started, 0)
        self.on_models_changed: list[Any] = []

    # ---- registry -------------------------------------------------------------
    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def load(self, name: str) -> None:
        """Load (or hot-reload) every selected version of ``name``."""
        validate_model_name(name)
        if self._closing:
            raise ModelNotReady("server is shutting down")
        async with self._lock(name):
            loop = asyncio.get_running_loop()
            try:
                built = await loop.run_in_executor(None, self._build, name)
            except FerryError as exc:
                self._failed[name] = exc.message
                raise
            except Exception as exc:  # a runtime's own failure
                self._failed[name] = str(exc)
                raise ModelNotReady(f"model {name!r} failed to load: {exc}") from exc
            for model in built.values():
                await model.batcher.start()
            old = self._models.get(name, {})
            self._models[name] = built
            self._failed.pop(name, None)
            log.info("loaded %s versions %s", name, sorted(built))
            self._changed()
            await self._retire(old.values())

    def _build(self, name: str) -> dict[int, LoadedModel]:
        """Create sessions off the event loop (loading a model blocks for a while)."""
        config = self.repository.read_config(name)
        versions = self.repository.selected_versions(name, config)
        if not versions:
            raise ModelNotFound(f"model {name!r} has no version with a model file")
        built: dict[int, LoadedModel] = {}
        try:
            for version in versions:
                before = _rss_bytes()
                backend, path = self.repository.model_file(name, version, config.backend)
                options = config.runtime.to_options(device=config.instance_group.kind)
                sessions = [load_session(backend, path, options)]
                vconfig = complete_config(config, sessions[0])
                for _ in range(vconfig.instance_group.count - 1):
                    sessions.append(load_session(backend, path, options))
                stats = ModelStats(name, version)
                stats.memory_bytes = max(_rss_bytes() - before, 0)
                batcher = DynamicBatcher(
                    model=name,
                    version=version,
                    sessions=sessions,
                    max_batch_size=vconfig.max_batch_size or 0,
                    policy=vconfig.dynamic_batching,
                    stats=stats,
                )
                built[version] = LoadedModel(name, version, vconfig, sessions, batcher, stats)
        except BaseException:
            for model in built.values():
                for session in model.sessions:
                    session.close()
            raise
        return built

    async def unload(self, name: str) -> None:
        validate_model_name(name)
        async with self._lock(name):
            old = self._models.pop(name, None)
            if old is None:
                raise ModelNotFound(f"model {name!r} is not loaded")
            self._changed()
            await self._retire(old.values())

    async def _retire(self, models: Iterable[LoadedModel]) -> None:
        for model in models:
            await model.batcher.stop(drain=True)
            for session in model.sessions:
                session.close()

    def _changed(self) -> None:
        for callback in list(self.on_models_changed):
            callback()

    async def close(self) -> None:
        """Stop accepting, finish queued work, close every runtime."""
        self._closing = True
        names = list(self._models)
        for name in names:
            old = self._models.pop(name, {})
            await self._retire(old.values())
        self._changed()

    # ---- lookups -------------------------------------------------------------
    def loaded_names(self) -> list[str]:
        return sorted(self._models)

    def is_ready(self) -> bool:
        return not self._closing

    def get(self, name: str, version: str | int | None = None) -> LoadedModel:
        versions = self._models.get(name)
        if not versions:
            if name in self._failed:
                raise ModelNotReady(f"model {name!r} is not ready: {self._failed[name]}")
            raise ModelNotFound(f"unknown model {name!r}")
        if version in (None, ""):
            return versions[max(versions)]
        try:
            number = int(version)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise InvalidInput(f"model version must be an integer, got {version!r}") from None
        model = versions.get(number)
        if model is None:
            raise ModelNotFound(f"model {name!r} has no loaded version {number}")
        return model

    def model_ready(self, name: str, version: str | None = None) -> bool:
        try:
            self.get(name, version)
        except FerryError:
            return False
        return not self._closing

    def metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        model = self.get(name, version)
        cfg = model.config
        batch = [-1] if cfg.max_batch_size else []

        def spec(t: Any) -> dict[str, Any]:
            return {"name": t.name, "datatype": t.datatype, "shape": batch + list(t.dims)}

        return {
            "name": name,
            "versions": [str(v) for v in sorted(self._models[name])],
            "platform": triton_model_config(cfg)["platform"],
            "inputs": [spec(t) for t in cfg.inputs],
            "outputs": [spec(t) for t in cfg.outputs],
        }

    def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        return triton_model_config(self.get(name, version).config)

    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        entries = []
        for entry in self.repository.index():
            loaded = self._models.get(entry["name"], {})
            version = entry.get("version")
            if version is not None and str(version).isdigit() and int(version) in loaded:
                entry = {**entry, "state": "READY", "reason": ""}
            elif entry["name"] in self._failed:
                entry = {**entry, "reason": self._failed[entry["name"]]}
            if not ready_only or entry["state"] == "READY":
                entries.append(entry)
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
        for versions in self._models.values():
            for m in versions.values():
                snap = m.stats.snapshot()
                compute_ns += snap.compute_infer_ns
                sessions += len(m.sessions)
                depth += m.batcher.queue_depth
                models.append(
                    {
                        "name": m.name,
                        "version": str(m.version),
                        "queue_depth": m.batcher.queue_depth,
                    }
                )
        mark_time, mark_ns = self._busy_mark
        elapsed = max(now - mark_time, 1e-9)
        utilisation = min(1.0, (compute_ns - mark_ns) / 1e9 / elapsed / max(sessions, 1))
        self._busy_mark = (now, compute_ns)
        return {
            "node": self.node,
            "state": "closing" if self._closing else "online",
            "models": models,
            "queue_depth": depth,
            "utilisation": round(max(utilisation, 0.0), 4),
            "uptime_s": round(now - self._started, 1),
        }

    # ---- inference ------------------------------------------------------------
    async def infer(
        self,
        name: str,
        request: InferRequest,
        *,
        version: str | None = None,
        deadline: float | None = None,
    ) -> InferResponse:
        start = time.monotonic()
        model = self.get(name, version or request.model_version)
        inputs = _validated_inputs(model.config, request)
        outputs = _validated_outputs(model.config, request)
        params = request.parameters
        priority = params.get("priority")
        if priority is not None and (type(priority) is not int or priority < 0):
            raise InvalidInput(f"priority must be a non-negative integer, got {priority!r}")
        timeout_us = params.get("timeout")
        if timeout_us is not None:
            if type(timeout_us) is not int or timeout_us < 0:
                raise InvalidInput(
                    f"timeout must be a non-negative integer (us), got {timeout_us!r}"
                )
            if timeout_us:
                t_deadline = start + timeout_us / 1e6
                deadline = t_deadline if deadline is None else min(deadline, t_deadline)
        result = await model.batcher.infer(
            inputs, outputs, deadline=deadline, priority=priority or None
        )
        names = outputs or [t.name for t in model.config.outputs] or list(result.outputs)
        tensors = [_output_tensor(n, result.outputs[n], model.config) for n in names]
        return InferResponse(
            model_name=name,
            model_version=str(model.version),
            id=request.id,
            outputs=tensors,
            parameters={
                "queue_us": result.queue_us,
                "compute_us": result.compute_us,
                "batch_size": result.batch_size,
                "node": self.node,
            },
        )


def _dims_match(expected: tuple[int, ...], got: tuple[int, ...]) -> bool:
    return len(expected) == len(got) and all(
        e in (-1, g) for e, g in zip(expected, got, strict=True)
    )


def _validated_inputs(config: ModelConfig, request: InferRequest) -> dict[str, np.ndarray]:
    expected = {t.name: t for t in config.inputs}
    given: dict[str, np.ndarray] = {}
    batch: int | None = None
    for tensor in request.inputs:
        spec = expected.get(tensor.name)
        if spec is None:
            raise InvalidInput(
                f"model {config.name!r} has no input {tensor.name!r}; inputs are {sorted(expected)}"
            )
        if tensor.datatype != spec.datatype:
            raise InvalidInput(
                f"input {tensor.name!r}: expected datatype {spec.datatype}, got {tensor.datatype}"
            )
        shape = tensor.shape
        if config.max_batch_size:
            if not shape or not 1 <= shape[0] <= config.max_batch_size:
                raise InvalidInput(
                    f"input {tensor.name!r}: batch dimension must be 1..{config.max_batch_size}, "
                    f"got shape {list(shape)}"
                )
            if batch is not None and shape[0] != batch:
                raise InvalidInput("all inputs of a request must share one batch size")
            batch = shape[0]
            inner = shape[1:]
        else:
            inner = shape
        if not _dims_match(spec.dims, inner):
            want = ([-1] if config.max_batch_size else []) + list(spec.dims)
            raise InvalidInput(f"input {tensor.name!r}: expected shape {want}, got {list(shape)}")
        given[tensor.name] = tensor.data
    missing = sorted(set(expected) - set(given))
    if missing:
        raise InvalidInput(f"model {config.name!r}: missing inputs {missing}")
    return given


def _validated_outputs(config: ModelConfig, request: InferRequest) -> list[str] | None:
    names = request.output_names()
    if names is None:
        return None
    known = {t.name for t in config.outputs}
    for name in names:
        if name not in known:
            raise InvalidInput(
                f"model {config.name!r} has no output {name!r}; outputs are {sorted(known)}"
            )
    return names


def _output_tensor(name: str, array: np.ndarray, config: ModelConfig) -> Tensor:
    for spec in config.outputs:
        if spec.name == name:
            return Tensor(name, spec.datatype, array)
    return Tensor.from_array(name, array)
