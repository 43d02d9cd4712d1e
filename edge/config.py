"""``agent.toml``: what the edge agent runs, where the cloud is, how to decide.

Parsed once into frozen dataclasses; the agent re-reads the file when it
changes and swaps the new configuration in only if it validates, so a typo
never takes a running agent down.  Every error names the file and the key.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.policy import MODES, TRANSPORTS, ModelPolicy, PolicyConfig, Weights
from shared.configcheck import NUMBER, check_keys
from shared.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class CloudEndpoints:
    mqtt_url: str | None = None
    http_url: str | None = None
    token: str | None = None
    ca_file: str | None = None
    tls_insecure: bool = False


@dataclass(frozen=True)
class AgentConfig:
    repository: Path
    state_dir: Path
    device: str = "x86-laptop"
    api_host: str = "127.0.0.1"
    api_port: int | None = 8080  # None: no local HTTP API
    cloud: CloudEndpoints = field(default_factory=CloudEndpoints)
    links: dict[str, str] = field(default_factory=lambda: {"mqtt": "wifi", "http": "wifi"})
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    local_threads: int = 0
    probe_interval_s: float = 5.0
    # Demos and tests on a fast machine can emulate a slower device: every
    # local inference is followed by a wait of (slowdown - 1) x its real time,
    # the way the link emulator stretches real transfers.  1.0 = off.
    local_slowdown: float = 1.0
    # Or a fixed device time: every local inference takes at least this long.
    # Unlike a large slowdown factor, it does not magnify the host's jitter.
    local_latency_ms: float = 0.0
    source: Path | None = None


_NUM = NUMBER
_SCHEMA: dict[str, Any] = {
    "repository": str,
    "state_dir": str,
    "device": str,
    "local_threads": int,
    "probe_interval_s": _NUM,
    "api": {"host": str, "port": int, "enabled": bool},
    "cloud": {"mqtt": str, "http": str, "token_file": str, "ca_file": str, "tls_insecure": bool},
    "links": {"mqtt": str, "http": str},
    "policy": {
        "deadline_ms": _NUM,
        "deadline_quantile": _NUM,
        "battery_floor_percent": _NUM,
        "data_cap_mb_per_day": _NUM,
        "explore_after_s": _NUM,
        "weights": {"latency_s": _NUM, "energy_j": _NUM, "data_mb": _NUM, "money": _NUM},
    },
    "models": dict,
    "emulation": {"local_slowdown": _NUM, "local_latency_ms": _NUM},
}
_MODEL_SCHEMA: dict[str, Any] = {
    "local": str,
    "cloud": str,
    "mode": str,
    "deadline_ms": _NUM,
    "cascade_threshold": _NUM,
    "cascade_output": str,
    "transports": list,
    "output_bytes": int,
}


def _model_policy(name: str, data: Any, source: str) -> ModelPolicy:
    key = f"models.{name}"
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: key {key!r}: expected a table")
    check_keys(data, _MODEL_SCHEMA, source, key + ".")
    mode = data.get("mode", "cost")
    if mode not in MODES:
        raise ConfigError(
            f"{source}: key '{key}.mode': expected one of {list(MODES)}, got {mode!r}"
        )
    transports = tuple(data.get("transports", TRANSPORTS))
    for t in transports:
        if t not in TRANSPORTS:
            raise ConfigError(
                f"{source}: key '{key}.transports': unknown transport {t!r}; expected {list(TRANSPORTS)}"
            )
    local = data.get("local")
    cloud = data.get("cloud")
    if mode == "local" and not local:
        raise ConfigError(f"{source}: key '{key}.local': mode 'local' needs a local model")
    if mode in ("cloud", "cascade") and not cloud:
        raise ConfigError(f"{source}: key '{key}.cloud': mode {mode!r} needs a cloud model")
    if mode == "cascade" and not local:
        raise ConfigError(f"{source}: key '{key}.local': mode 'cascade' needs a local model")
    threshold = data.get("cascade_threshold", 0.8)
    if not 0 <= threshold <= 1:
        raise ConfigError(
            f"{source}: key '{key}.cascade_threshold': expected 0..1, got {threshold}"
        )
    deadline = data.get("deadline_ms")
    if deadline is not None and deadline <= 0:
        raise ConfigError(f"{source}: key '{key}.deadline_ms': expected a positive number")
    return ModelPolicy(
        mode=mode,
        local_model=local,
        cloud_model=cloud,
        deadline_ms=deadline,
        cascade_threshold=float(threshold),
        cascade_output=data.get("cascade_output"),
        transports=transports,
        output_bytes=data.get("output_bytes", 4096),
    )


def parse_agent_config(text: str, source: str, base: Path) -> AgentConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    check_keys(data, _SCHEMA, source)
    if "repository" not in data:
        raise ConfigError(f"{source}: key 'repository' is required")
    pol = data.get("policy", {})
    weights = Weights(**{k: float(v) for k, v in pol.get("weights", {}).items()})
    if any(v < 0 for v in (weights.latency_s, weights.energy_j, weights.data_mb, weights.money)):
        raise ConfigError(f"{source}: key 'policy.weights': weights must be non-negative")
    quantile = float(pol.get("deadline_quantile", 0.95))
    if not 0.5 <= quantile < 1:
        raise ConfigError(
            f"{source}: key 'policy.deadline_quantile': expected 0.5..0.999, got {quantile}"
        )
    models = {name: _model_policy(name, m, source) for name, m in data.get("models", {}).items()}
    policy = PolicyConfig(
        weights=weights,
        deadline_quantile=quantile,
        battery_floor_percent=float(pol.get("battery_floor_percent", 15.0)),
        data_cap_mb_per_day=pol.get("data_cap_mb_per_day"),
        default_deadline_ms=float(pol.get("deadline_ms", 1000.0)),
        explore_after_s=float(pol.get("explore_after_s", 10.0)),
        models=models,
    )
    cloud = data.get("cloud", {})
    token = None
    if cloud.get("token_file"):
        try:
            token = (base / cloud["token_file"]).read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"{source}: key 'cloud.token_file': cannot read: {exc.strerror}"
            ) from None
    emulation = data.get("emulation", {})
    slowdown = float(emulation.get("local_slowdown", 1.0))
    if slowdown < 1.0:
        raise ConfigError(
            f"{source}: key 'emulation.local_slowdown': expected >= 1, got {slowdown}"
        )
    floor_ms = float(emulation.get("local_latency_ms", 0.0))
    if floor_ms < 0:
        raise ConfigError(
            f"{source}: key 'emulation.local_latency_ms': expected >= 0, got {floor_ms}"
        )
    api = data.get("api", {})
    links = {"mqtt": "wifi", "http": "wifi", **data.get("links", {})}
    return AgentConfig(
        repository=(base / data["repository"]).resolve(),
        state_dir=(base / data.get("state_dir", ".ferry-edge")).resolve(),
        device=data.get("device", "x86-laptop"),
        api_host=api.get("host", "127.0.0.1"),
        api_port=api.get("port", 8080) if api.get("enabled", True) else None,
        cloud=CloudEndpoints(
            mqtt_url=cloud.get("mqtt"),
            http_url=cloud.get("http"),
            token=token,
            ca_file=cloud.get("ca_file"),
            tls_insecure=cloud.get("tls_insecure", False),
        ),
        links=links,
        policy=policy,
        local_threads=data.get("local_threads", 0),
        probe_interval_s=float(data.get("probe_interval_s", 5.0)),
        local_slowdown=slowdown,
        local_latency_ms=floor_ms,
    )


def load_agent_config(path: Path) -> AgentConfig:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    config = parse_agent_config(text, str(path), Path(path).resolve().parent)
    return AgentConfig(**{**config.__dict__, "source": Path(path)})


def load_policy_file(path: Path) -> PolicyConfig:
    """The ``[policy]`` and ``[models.*]`` of an agent.toml, or of a policy-only file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    if "repository" not in data:
        text = 'repository = "."\n' + text
    return parse_agent_config(text, str(path), Path(path).resolve().parent).policy
