"""The model configuration schema (``<repo>/<model>/config.toml``).

Every key is optional where the model file can tell it: a folder holding
only ``1/model.onnx`` serves with the defaults below, and
:func:`complete_config` fills backend, tensors and batching from the loaded
session.  Anything the file cannot tell is checked strictly: an unknown key
or a wrong value is a :class:`~shared.errors.ConfigError` naming the file,
the dotted key and what was expected, because a silently ignored typo in a
serving config is found only in production.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shared.configcheck import loads_toml
from shared.datatypes import DATATYPES
from shared.errors import ConfigError
from shared.pipeline.spec import ImageInput, OutputStage
from shared.repository.checks import (
    check_bool,
    check_choice,
    check_dims,
    check_int,
    check_int_list,
    check_name,
    check_number,
    check_table,
    check_unique,
    fail,
)
from shared.repository.stages import parse_postprocess, parse_preprocess
from shared.runtimes import BACKENDS
from shared.runtimes.base import RuntimeOptions, TensorSpec

#: max_batch_size given to a model whose config leaves it out and whose every
#: tensor has a dynamic first dimension (raised to the largest preferred batch
#: size when that is larger).  Triton's auto-complete picks 4; 32 suits the
#: small CNNs Ferry serves on CPUs, whose throughput keeps rising up to ~32.
DEFAULT_MAX_BATCH_SIZE = 32

INSTANCE_KINDS = ("cpu", "gpu")
#: values of ``runtime.precision_hint`` (OpenVINO's INFERENCE_PRECISION_HINT)
PRECISION_HINTS = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class DynamicBatching:
    """``[dynamic_batching]``; priority 1 is the highest, 0 in a limit means none."""

    max_queue_delay_us: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 0
    priority_levels: int = 1
    default_priority_level: int = 1
    default_timeout_us: int = 0
    #: Triton's key, read and shown: a request's own deadline may shorten
    #: ``default_timeout_us``, never extend it, either way (Triton's true; Triton's false
    #: ignores a shorter one, which Ferry honours: it is the client's own bound)
    allow_timeout_override: bool = False
    #: answers leave in the order their requests came (Triton's preserve_ordering)
    preserve_ordering: bool = False


@dataclass(frozen=True)
class InstanceGroup:
    count: int = 1
    kind: str = "cpu"


@dataclass(frozen=True)
class VersionPolicy:
    """Which version folders to serve; ``specific`` wins over ``all``, which wins over ``latest``."""

    latest: int | None = 1
    all: bool = False
    specific: tuple[int, ...] = ()

    def select(self, available: list[int]) -> list[int]:
        """The versions to serve, ascending; a missing ``specific`` version is an error
        (serving a different version than the one asked for would be worse)."""
        versions = sorted(set(available))
        if self.specific:
            missing = sorted(set(self.specific) - set(versions))
            if missing:
                raise ConfigError(
                    f"version policy names versions {missing} that do not exist; "
                    f"available versions are {versions}"
                )
            return sorted(set(self.specific))
        if self.all:
            return versions
        n = self.latest if self.latest is not None else 1
        return versions[-n:] if n > 0 else []


@dataclass(frozen=True)
class RuntimeConfig:
    """``[runtime]``: ``threads = 0`` means the cores given to the process.

    ``lone_threads``: intra-op threads of one more session, which runs a lone
    request while nothing else runs on the node, so a request on an idle node
    is answered at the runtime's fastest batch-1 speed although the instances
    are sized for throughput (one thread each, say).  None: the node's cores
    when an instance has fewer; 0: no such session (it costs one more copy of
    the model in memory).
    """

    threads: int = 0
    precision_hint: str | None = None
    allow_spinning: bool = False
    lone_threads: int | None = None

    def to_options(self, device: str = "cpu") -> RuntimeOptions:
        return RuntimeOptions(
            threads=self.threads or None,
            device=device,
            precision_hint=self.precision_hint,
            allow_spinning=self.allow_spinning,
        )


@dataclass(frozen=True)
class PlacementPolicy:
    """``[placement]``: what the fleet controller must respect when it places the model.

    ``latency_objective_ms`` is the server-side objective (arrival to answer) the
    packer sizes batches for; ``rate`` is the request rate to plan for until one is
    observed; ``min_copies = 0`` lets an idle model be left unloaded (ModelMesh's
    cache); ``max_copies = 0`` means no cap beyond one copy per node; ``backends``
    limits the backends the controller may choose (empty: any the model runs on).
    """

    latency_objective_ms: float = 100.0
    min_copies: int = 1
    max_copies: int = 0
    rate: float = 0.0
    backends: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    """One model's configuration.

    Before :func:`complete_config`, ``backend`` and ``max_batch_size`` may be
    None and the tensors empty (the file will tell).  When ``max_batch_size``
    is above 0 the tensor dims leave out the batch dimension.
    ``max_batch_size_inferred``: the config left it out and the file's dynamic
    first dimensions gave it.  It then bounds only the batches Ferry merges:
    a request of any size the runtime accepts runs (alone, when above it), as a
    time-major ``[T, F]`` input that looks batched must not be capped at 32 steps.
    """

    name: str
    backend: str | None = None
    max_batch_size: int | None = None
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    dynamic_batching: DynamicBatching | None = None
    instance_group: InstanceGroup = field(default_factory=InstanceGroup)
    version_policy: VersionPolicy = field(default_factory=VersionPolicy)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    placement: PlacementPolicy = field(default_factory=PlacementPolicy)
    preprocess: tuple[ImageInput, ...] = ()
    postprocess: tuple[OutputStage, ...] = ()
    source: Path | None = None
    max_batch_size_inferred: bool = False


# ---- config.toml -------------------------------------------------------------------------

#: config.toml's top-level keys (a load override's, in Ferry's form)
TOP_KEYS = (
    "backend",
    "max_batch_size",
    "input",
    "output",
    "dynamic_batching",
    "instance_group",
    "version_policy",
    "runtime",
    "placement",
    "preprocess",
    "postprocess",
)
_TENSOR = ("name", "datatype", "dims")
_BATCHING = (  # preferred_batch_sizes first: the others are integers
    "preferred_batch_sizes",
    "max_queue_delay_us",
    "max_queue_size",
    "priority_levels",
    "default_priority_level",
    "default_timeout_us",
    "allow_timeout_override",
    "preserve_ordering",
)


def parse_config(path: Path, name: str) -> ModelConfig:
    """Read and check ``config.toml``; errors name ``path``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ConfigError(f"{path}: cannot read: {reason}") from None
    data = loads_toml(text, str(path))
    return replace(parse_config_dict(data, str(path), name), source=path)


def parse_config_dict(data: dict, source: str, name: str) -> ModelConfig:
    """Check an already-decoded config; ``source`` names it in error messages."""
    check_table(data, source, "", TOP_KEYS)
    backend = None
    if "backend" in data:
        backend = check_choice(data["backend"], source, "backend", tuple(BACKENDS))
    max_batch_size = None
    if "max_batch_size" in data:
        max_batch_size = check_int(data["max_batch_size"], source, "max_batch_size")
    inputs = _tensors(data.get("input", []), source, "input")
    outputs = _tensors(data.get("output", []), source, "output")
    batching = None
    if "dynamic_batching" in data:
        batching = _batching(data["dynamic_batching"], source)
        check_preferred(batching, max_batch_size, source)
    return ModelConfig(
        name=name,
        backend=backend,
        max_batch_size=max_batch_size,
        inputs=inputs,
        outputs=outputs,
        dynamic_batching=batching,
        instance_group=_instance_group(data.get("instance_group", {}), source),
        version_policy=_version_policy(data.get("version_policy", {}), source),
        runtime=_runtime(data.get("runtime", {}), source),
        placement=_placement(data.get("placement", {}), source),
        preprocess=parse_preprocess(data.get("preprocess", []), source),
        postprocess=parse_postprocess(data.get("postprocess", []), source),
    )


def parse_config_json(
    text: object, name: str, source: str = "load request: parameter 'config'"
) -> ModelConfig:
    """Triton's load-time override: a JSON string holding a whole model configuration.

    The keys are Ferry's, the same as ``config.toml`` (checked by the same
    code, so errors name the dotted key); like Triton's override it replaces
    the repository's configuration for this load instead of merging with it.
    """
    return parse_config_dict(json_object(text, source), source, name)


def json_object(text: object, source: str) -> dict[str, Any]:
    """The JSON object a load request's ``config`` string holds."""
    if not isinstance(text, str):
        raise ConfigError(f"{source}: expected a JSON string holding the configuration")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{source}: not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
    return data


def _tensors(value: object, source: str, key: str) -> tuple[TensorSpec, ...]:
    if not isinstance(value, list):
        fail(source, key, f"an array of tables ([[{key}]])", value)
    specs = []
    for i, item in enumerate(value):
        at = f"{key}[{i}]"
        table = check_table(item, source, at, (*_TENSOR, "reshape"))
        for required in _TENSOR:
            if required not in table:
                raise ConfigError(f"{source}: key '{at}.{required}' is required")
        specs.append(
            TensorSpec(
                name=check_name(table["name"], source, f"{at}.name"),
                datatype=check_choice(
                    table["datatype"], source, f"{at}.datatype", tuple(sorted(DATATYPES))
                ),
                dims=check_dims(table["dims"], source, f"{at}.dims"),
                reshape=(
                    check_dims(table["reshape"], source, f"{at}.reshape")
                    if "reshape" in table
                    else None
                ),
            )
        )
    result = tuple(specs)
    check_unique(result, source, key)
    return result


def _batching(value: object, source: str) -> DynamicBatching:
    t = check_table(value, source, "dynamic_batching", _BATCHING)
    k = "dynamic_batching."
    ints = {f: check_int(t[f], source, k + f) for f in _BATCHING[1:-2] if f in t}
    preferred = check_int_list(
        t.get("preferred_batch_sizes", []), source, k + "preferred_batch_sizes", 1
    )
    override = check_bool(
        t.get("allow_timeout_override", False), source, k + "allow_timeout_override"
    )
    batching = DynamicBatching(
        preferred_batch_sizes=tuple(sorted(set(preferred))),
        allow_timeout_override=override,
        preserve_ordering=check_bool(
            t.get("preserve_ordering", False), source, k + "preserve_ordering"
        ),
        **ints,
    )
    levels, default = batching.priority_levels, batching.default_priority_level
    if levels > 1 and "default_priority_level" not in t:
        # (as Triton: read as level 1, requests without a priority jumped every other)
        fail(source, k + "default_priority_level", f"a level from 1 to {levels}", "none")
    if levels > 0 and not 1 <= default <= levels:
        fail(source, k + "default_priority_level", f"a level from 1 to {levels}", default)
    return batching


def check_preferred(
    batching: DynamicBatching | None, max_batch_size: int | None, source: str
) -> None:
    """Preferred batch sizes must fit the batch dimension (once it is known)."""
    if batching is None or max_batch_size is None or not batching.preferred_batch_sizes:
        return
    too_big = [p for p in batching.preferred_batch_sizes if p > max_batch_size]
    if too_big:
        raise ConfigError(
            f"{source}: key 'dynamic_batching.preferred_batch_sizes': expected sizes up to "
            f"max_batch_size ({max_batch_size}), got {too_big}"
        )


def _instance_group(value: object, source: str) -> InstanceGroup:
    t = check_table(value, source, "instance_group", ("count", "kind"))
    return InstanceGroup(
        count=check_int(t.get("count", 1), source, "instance_group.count", 1),
        kind=check_choice(t.get("kind", "cpu"), source, "instance_group.kind", INSTANCE_KINDS),
    )


def _version_policy(value: object, source: str) -> VersionPolicy:
    t = check_table(value, source, "version_policy", ("latest", "all", "specific"))
    given = [k for k in ("latest", "all", "specific") if k in t]
    if len(given) > 1:
        raise ConfigError(
            f"{source}: key 'version_policy': expected exactly one of 'latest', 'all' or "
            f"'specific', got {given}"
        )
    if "all" in t:
        if not check_bool(t["all"], source, "version_policy.all"):
            fail(source, "version_policy.all", "true (or use 'latest' / 'specific')", False)
        return VersionPolicy(latest=None, all=True)
    if "specific" in t:
        versions = check_int_list(t["specific"], source, "version_policy.specific")
        if not versions:
            fail(source, "version_policy.specific", "a non-empty list of versions", [])
        return VersionPolicy(latest=None, specific=tuple(sorted(set(versions))))
    return VersionPolicy(latest=check_int(t.get("latest", 1), source, "version_policy.latest", 1))


def _runtime(value: object, source: str) -> RuntimeConfig:
    t = check_table(
        value, source, "runtime", ("threads", "precision_hint", "allow_spinning", "lone_threads")
    )
    hint = t.get("precision_hint")
    lone = t.get("lone_threads")
    return RuntimeConfig(
        lone_threads=None if lone is None else check_int(lone, source, "runtime.lone_threads"),
        threads=check_int(t.get("threads", 0), source, "runtime.threads"),
        precision_hint=(
            None
            if hint is None
            else check_choice(hint, source, "runtime.precision_hint", PRECISION_HINTS)
        ),
        allow_spinning=check_bool(t.get("allow_spinning", False), source, "runtime.allow_spinning"),
    )


_PLACEMENT = ("latency_objective_ms", "min_copies", "max_copies", "rate", "backends")


def _placement(value: object, source: str) -> PlacementPolicy:
    t = check_table(value, source, "placement", _PLACEMENT)
    k = "placement."
    backends = t.get("backends", [])
    if not isinstance(backends, list):
        fail(source, k + "backends", "a list of backend names", backends)
    chosen = tuple(check_choice(b, source, k + "backends", tuple(BACKENDS)) for b in backends)
    policy = PlacementPolicy(
        latency_objective_ms=check_number(
            t.get("latency_objective_ms", 100.0), source, k + "latency_objective_ms", True
        ),
        min_copies=check_int(t.get("min_copies", 1), source, k + "min_copies"),
        max_copies=check_int(t.get("max_copies", 0), source, k + "max_copies"),
        rate=check_number(t.get("rate", 0.0), source, k + "rate", False),
        backends=chosen,
    )
    if policy.max_copies and policy.max_copies < policy.min_copies:
        fail(
            source,
            k + "max_copies",
            f"0 or at least min_copies ({policy.min_copies})",
            policy.max_copies,
        )
    return policy
