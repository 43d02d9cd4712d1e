"""``agent.toml``: what the edge agent runs, where the cloud is, how to decide.

Parsed once into frozen dataclasses; the agent re-reads the file when it
changes and swaps the new configuration in only if it validates, so a typo
never takes a running agent down.  Every error names the file and the key,
including the ones only a lookup can find (an unknown device or link
profile, a bad broker URL, an unreadable credentials file).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from devices.profiles import load_device, load_link
from edge.core.policy import MODES, TRANSPORTS, ModelPolicy, PolicyConfig, Weights
from shared.configcheck import NUMBER, check_keys, loads_toml, read_config_text, read_toml
from shared.errors import ConfigError, InvalidInput
from shared.mqtt import parse_broker_url
from shared.redact import redact_url
from shared.repository.repository import validate_model_name

#: What an agent runs on when its agent.toml names no device and no link profiles.
AGENT_DEFAULT_DEVICE = "x86-laptop"
AGENT_DEFAULT_LINK = "wifi"


def _agent_links(data: dict[str, Any]) -> dict[str, Any]:
    """An agent.toml's [links], the default profile for each transport it leaves out."""
    return {t: AGENT_DEFAULT_LINK for t in TRANSPORTS} | data.get("links", {})


@dataclass(frozen=True)
class CloudEndpoints:
    mqtt_url: str | None = field(default=None, repr=False)  # (shown redacted: __repr__)
    http_url: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    tls_insecure: bool = False
    cert_file: str | None = None  # client certificate (mutual TLS), MQTT and HTTP
    key_file: str | None = None
    mqtt_password: str | None = field(default=None, repr=False)  # user name rides in the URL
    mqtt_client_id: str | None = None  # (None: a fresh random one per start)
    mqtt_keepalive_s: int = 30  # (a cellular NAT's idle timeout and the battery decide it)

    def __repr__(self) -> str:
        shown = {
            "mqtt_url": None if self.mqtt_url is None else redact_url(self.mqtt_url),
            "http_url": None if self.http_url is None else redact_url(self.http_url),
        }
        rest = {
            f.name: getattr(self, f.name) for f in fields(self) if f.repr and f.name not in shown
        }
        return f"CloudEndpoints({', '.join(f'{k}={v!r}' for k, v in (shown | rest).items())})"


@dataclass(frozen=True)
class StoreConfig:
    """Store-and-forward: how long a deferred request waits for a link, how long answers stay."""

    ttl_s: float = 24 * 3600.0
    keep_results_s: float = 7 * 24 * 3600.0
    max_attempts: int = 5
    max_requests: int = 10_000  # waiting requests before a deferral is refused
    max_bytes: int = 256 << 20  # and their bytes


@dataclass(frozen=True)
class AgentConfig:
    repository: Path
    state_dir: Path
    device: str = "x86-laptop"
    api_host: str = "127.0.0.1"
    api_port: int | None = 8080  # None: no local HTTP API
    api_tokens_file: Path | None = None  # bearer tokens for the local API (health stays open)
    #: request bytes the local API holds at once (0: no bound): past it "overloaded"
    api_max_inflight_bytes: int = 64 << 20
    cloud: CloudEndpoints = field(default_factory=CloudEndpoints)
    links: dict[str, str] = field(default_factory=lambda: {"mqtt": "wifi", "http": "wifi"})
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    local_threads: int = 0
    #: a local model whose recent runs took under this runs on the event loop when
    #: nothing waits for it (shared.runtimes.inline); 0: always on its worker thread
    local_inline_us: float = 100.0
    probe_interval_s: float = 5.0
    store: StoreConfig = field(default_factory=StoreConfig)
    # Demos and tests on a fast machine can emulate a slower device: every
    # local inference is followed by a wait of (slowdown - 1) x its real time,
    # the way the link emulator stretches real transfers.  1.0 = off.
    local_slowdown: float = 1.0
    # Or a fixed device time: every local inference takes at least this long.
    # Unlike a large slowdown factor, it does not magnify the host's jitter.
    local_latency_ms: float = 0.0
    source: Path | None = None


# Keys a running agent cannot change: a reload that edits them is logged and
# the new values wait for a restart (everything else is applied live).
RESTART_KEYS = (
    "repository",
    "state_dir",
    "api_host",
    "api_port",
    "api_tokens_file",
    "api_max_inflight_bytes",
    "cloud",
    "local_threads",
    "local_inline_us",
)

_NUM = NUMBER
_SCHEMA: dict[str, Any] = {
    "repository": str,
    "state_dir": str,
    "device": str,
    "local_threads": int,
    "local_inline_us": _NUM,
    "probe_interval_s": _NUM,
    "api": {
        "host": str,
        "port": int,
        "enabled": bool,
        "tokens_file": str,
        "max_inflight_bytes": int,
    },
    "cloud": {
        "mqtt": str,
        "http": str,
        "token_file": str,
        "ca_file": str,
        "tls_insecure": bool,
        "cert_file": str,
        "key_file": str,
        "password_file": str,
        "client_id": str,
        "keepalive_s": int,
    },
    "links": {"mqtt": str, "http": str},
    "store": {
        "ttl_s": _NUM,
        "keep_results_s": _NUM,
        "max_attempts": int,
        "max_requests": int,
        "max_bytes": int,
    },
    "policy": {
        "deadline_ms": _NUM,
        "deadline_quantile": _NUM,
        "battery_floor_percent": _NUM,
        "data_cap_mb_per_day": _NUM,
        "explore_after_s": _NUM,
        "warm_up_runs": int,
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


def _range(
    source: str,
    key: str,
    value: float,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    finite: bool = False,
) -> float:
    bad = (
        value != value  # NaN compares false with everything: refuse it outright
        or (finite and not math.isfinite(value))
        or (low is not None and (value <= low if low_open else value < low))
        or (high is not None and value > high)
    )
    if bad:
        lo = "" if low is None else (f"> {low}" if low_open else f">= {low}")
        hi = "" if high is None else f"<= {high}"
        what = "a finite value" if finite else "a value"
        raise ConfigError(
            f"{source}: key {key!r}: expected {what} {' and '.join(x for x in (lo, hi) if x)}, got {value}"
        )
    return value


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
    if not local and not cloud:
        raise ConfigError(f"{source}: key {key!r}: needs a local model, a cloud model or both")
    for part, named in (("local", local), ("cloud", cloud)):
        if named is None:
            continue
        try:
            validate_model_name(named)
        except InvalidInput as exc:
            # (a model repository's rule, on both tiers: unchecked, a cloud name went into
            # the URL as it was, '中文' a 500 and 'a.b/versions/1' another model's path)
            raise ConfigError(f"{source}: key '{key}.{part}': {exc.message}") from None
    threshold = _range(source, f"{key}.cascade_threshold", data.get("cascade_threshold", 0.8), 0, 1)
    deadline = data.get("deadline_ms")
    if deadline is not None:
        _range(source, f"{key}.deadline_ms", deadline, 0, low_open=True, finite=True)
    output_bytes = int(_range(source, f"{key}.output_bytes", data.get("output_bytes", 4096), 0))
    return ModelPolicy(
        mode=mode,
        local_model=local,
        cloud_model=cloud,
        deadline_ms=deadline,
        cascade_threshold=float(threshold),
        cascade_output=data.get("cascade_output"),
        transports=transports,
        output_bytes=output_bytes,
    )


#: the largest weight a policy file may give (their ratios are what counts)
MAX_WEIGHT = 1e6


def _policy(data: dict[str, Any], source: str) -> PolicyConfig:
    pol = data.get("policy", {})
    weights = Weights(**{k: float(v) for k, v in pol.get("weights", {}).items()})
    for key, value in (
        ("latency_s", weights.latency_s),
        ("energy_j", weights.energy_j),
        ("data_mb", weights.data_mb),
        ("money", weights.money),
    ):
        # Only their ratios matter; past 1e6 a cost (a weight times seconds, joules or
        # MB) can overflow to inf and its differences to NaN: scale them all down.
        if not 0 <= value <= MAX_WEIGHT:  # also NaN
            raise ConfigError(
                f"{source}: key 'policy.weights.{key}': expected a number from 0 to "
                f"{MAX_WEIGHT:g} (only the weights' ratios matter), got {value}"
            )
    quantile = float(pol.get("deadline_quantile", 0.95))
    if not 0.5 <= quantile < 1:
        raise ConfigError(
            f"{source}: key 'policy.deadline_quantile': expected at least 0.5 and below 1, "
            f"got {quantile}"
        )
    cap = pol.get("data_cap_mb_per_day")
    if cap is not None:
        _range(source, "policy.data_cap_mb_per_day", cap, 0)
    models = {name: _model_policy(name, m, source) for name, m in data.get("models", {}).items()}
    return PolicyConfig(
        weights=weights,
        deadline_quantile=quantile,
        battery_floor_percent=_range(
            source,
            "policy.battery_floor_percent",
            float(pol.get("battery_floor_percent", 15.0)),
            0,
            100,
        ),
        data_cap_mb_per_day=cap,
        default_deadline_ms=_range(
            source,
            "policy.deadline_ms",
            float(pol.get("deadline_ms", 1000.0)),
            0,
            low_open=True,
            finite=True,
        ),
        explore_after_s=_range(
            source, "policy.explore_after_s", float(pol.get("explore_after_s", 10.0)), 0
        ),
        warm_up_runs=int(
            _range(source, "policy.warm_up_runs", int(pol.get("warm_up_runs", 5)), 1, 100)
        ),
        models=models,
    )


def _profile(kind: str, value: str, key: str, source: str, base: Path) -> str:
    """A device/link name, or a path resolved against the config's folder; checked now."""
    is_path = value.endswith(".toml") or "/" in value or "\\" in value
    resolved = str((base / value).resolve()) if is_path else value
    try:
        (load_device if kind == "device" else load_link)(resolved)
    except ConfigError as exc:
        raise ConfigError(f"{source}: key {key!r}: {exc.message}") from None
    return resolved


def _read_secret(base: Path, value: str, key: str, source: str) -> str:
    try:
        return (base / value).read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"{source}: key {key!r}: cannot read {base / value}: {exc.strerror}"
        ) from None


def _existing(base: Path, value: str | None, key: str, source: str) -> str | None:
    if value is None:
        return None
    path = (base / value).resolve()
    if not path.is_file():
        raise ConfigError(f"{source}: key {key!r}: no such file {str(path)!r}")
    return str(path)


def _cloud(data: dict[str, Any], source: str, base: Path) -> CloudEndpoints:
    cloud = data.get("cloud", {})
    mqtt_url, http_url = cloud.get("mqtt"), cloud.get("http")
    if mqtt_url is not None:
        try:
            parse_broker_url(mqtt_url)
        except ConfigError as exc:
            raise ConfigError(f"{source}: key 'cloud.mqtt': {exc.message}") from None
    if http_url is not None:
        try:
            parts = urlsplit(http_url)
            parts.port  # noqa: B018 - raises for a port past 65535
        except ValueError:  # that, or an unclosed IPv6 bracket
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"{source}: key 'cloud.http': expected an http:// or https:// URL, got "
                f"{redact_url(http_url)!r}"
            )
    if cloud.get("key_file") and not cloud.get("cert_file"):
        raise ConfigError(f"{source}: key 'cloud.key_file': needs cloud.cert_file as well")
    secure = (mqtt_url or "").startswith("mqtts://") or (http_url or "").startswith("https://")
    for key in ("ca_file", "cert_file", "key_file", "tls_insecure"):
        if cloud.get(key) and not secure:
            raise ConfigError(
                f"{source}: key 'cloud.{key}': TLS options need an mqtts:// or https:// "
                "endpoint, but every endpoint is plain"
            )
    token = cloud.get("token_file")
    password = cloud.get("password_file")
    client_id = cloud.get("client_id")
    if client_id is not None and not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", client_id):
        raise ConfigError(
            f"{source}: key 'cloud.client_id': use 1-64 letters, digits, '.', '_' or '-' "
            f"(it names the agent's reply topic), got {client_id!r}"
        )
    keepalive = cloud.get("keepalive_s", 30)
    if not 0 <= keepalive <= 65535:
        raise ConfigError(
            f"{source}: key 'cloud.keepalive_s': expected seconds from 0 (none) to 65535, "
            f"got {keepalive}"
        )
    return CloudEndpoints(
        mqtt_url=mqtt_url,
        http_url=http_url,
        token=_read_secret(base, token, "cloud.token_file", source) if token else None,
        ca_file=_existing(base, cloud.get("ca_file"), "cloud.ca_file", source),
        tls_insecure=cloud.get("tls_insecure", False),
        cert_file=_existing(base, cloud.get("cert_file"), "cloud.cert_file", source),
        key_file=_existing(base, cloud.get("key_file"), "cloud.key_file", source),
        mqtt_password=(
            _read_secret(base, password, "cloud.password_file", source) if password else None
        ),
        mqtt_client_id=client_id,
        mqtt_keepalive_s=keepalive,
    )


def check_reachable(policy: PolicyConfig, cloud: CloudEndpoints, source: str) -> None:
    """A model that needs the cloud must name a transport with an endpoint in [cloud]:
    one without was taken, reported ready, and every request got 503 (or, with a
    local variant beside ``mode = "cloud"``, ran locally as a fallback, every time)."""
    endpoints = {name for name, url in (("http", cloud.http_url), ("mqtt", cloud.mqtt_url)) if url}
    for name, mp in policy.models.items():
        if (
            mp.cloud_model is None
            or mp.mode == "local"
            or (mp.local_model is not None and mp.mode == "cost")
        ):
            continue  # no cloud model, or one the policy may do without
        if not endpoints.intersection(mp.transports):
            have = f"[cloud] names {sorted(endpoints)}" if endpoints else "[cloud] names none"
            raise ConfigError(
                f"{source}: key 'models.{name}.transports': {list(mp.transports)} has no "
                f"endpoint ({have}): model {name!r} needs the cloud (mode {mp.mode!r}"
                f"{'' if mp.local_model else ', no local model'})"
            )


def unreachable_transports(
    policy: PolicyConfig, endpoints: Iterable[str] | None, model: str | None = None
) -> list[str]:
    """Why each cost-mode model (of ``model``, or all) with a local variant will never
    offload: none of its transports has an endpoint (``endpoints``; None: any has).
    Legal, as the local variant answers everything, so said rather than refused: the
    agent and the replay both went on silently, always local."""
    if endpoints is None:
        return []
    have = set(endpoints)
    notes = []
    for name, mp in policy.models.items():
        if model is not None and name != model:
            continue
        if mp.mode == "cost" and mp.local_model and mp.cloud_model:
            if not have.intersection(mp.transports):
                where = f"there are {sorted(have)}" if have else "[cloud] names none"
                notes.append(
                    f"model {name!r}: its transports {list(mp.transports)} have no endpoint "
                    f"({where}): it never offloads"
                )
    return notes


def parse_agent_config(text: str, source: str, base: Path) -> AgentConfig:
    data = loads_toml(text, source)
    check_keys(data, _SCHEMA, source)
    if "repository" not in data:
        raise ConfigError(f"{source}: key 'repository' is required")
    emulation = data.get("emulation", {})
    slowdown = float(
        _range(source, "emulation.local_slowdown", emulation.get("local_slowdown", 1.0), 1)
    )
    floor_ms = float(
        _range(source, "emulation.local_latency_ms", emulation.get("local_latency_ms", 0.0), 0)
    )
    api = data.get("api", {})
    port = int(_range(source, "api.port", api.get("port", 8080), 0, 65535))
    links = {
        t: _profile("link", name, f"links.{t}", source, base)
        for t, name in _agent_links(data).items()
    }
    store = data.get("store", {})
    cloud = _cloud(data, source, base)
    policy = _policy(data, source)
    check_reachable(policy, cloud, source)
    return AgentConfig(
        repository=(base / data["repository"]).resolve(),
        state_dir=(base / data.get("state_dir", ".ferry-edge")).resolve(),
        device=_profile("device", data.get("device", AGENT_DEFAULT_DEVICE), "device", source, base),
        api_host=api.get("host", "127.0.0.1"),
        api_port=port if api.get("enabled", True) else None,
        api_tokens_file=(base / api["tokens_file"]).resolve() if api.get("tokens_file") else None,
        api_max_inflight_bytes=int(
            _range(source, "api.max_inflight_bytes", api.get("max_inflight_bytes", 64 << 20), 0)
        ),
        cloud=cloud,
        links=links,
        policy=policy,
        local_threads=int(_range(source, "local_threads", data.get("local_threads", 0), 0, 1024)),
        local_inline_us=float(
            _range(source, "local_inline_us", data.get("local_inline_us", 100.0), 0, 10_000)
        ),
        probe_interval_s=float(
            _range(source, "probe_interval_s", data.get("probe_interval_s", 5.0), 0, low_open=True)
        ),
        store=StoreConfig(
            ttl_s=float(
                _range(source, "store.ttl_s", store.get("ttl_s", 86400.0), 0, low_open=True)
            ),
            keep_results_s=float(
                _range(source, "store.keep_results_s", store.get("keep_results_s", 604800.0), 0)
            ),
            max_attempts=int(_range(source, "store.max_attempts", store.get("max_attempts", 5), 1)),
            max_requests=int(
                _range(source, "store.max_requests", store.get("max_requests", 10_000), 1)
            ),
            max_bytes=int(_range(source, "store.max_bytes", store.get("max_bytes", 256 << 20), 1)),
        ),
        local_slowdown=slowdown,
        local_latency_ms=floor_ms,
    )


def load_agent_config(path: Path) -> AgentConfig:
    text = read_config_text(path)
    config = parse_agent_config(text, str(path), Path(path).resolve().parent)
    return AgentConfig(**{**config.__dict__, "source": Path(path)})


@dataclass(frozen=True)
class FileSettings:
    """What a replay takes from an agent.toml beside its policy (None: the file is silent)."""

    transports: tuple[str, ...] | None = None  # those with an endpoint in [cloud]
    probe_interval_s: float | None = None
    links: dict[str, str] = field(default_factory=dict)  # transport -> profile (resolved)
    device: str | None = None


def agent_file_settings(path: Path) -> FileSettings:
    """The endpoints, probe interval, ``[links]`` and ``device`` of an agent.toml, checked
    and resolved (paths against the file's folder) as the agent would; a policy-only
    file gives none.  ``ferry-edge evaluate`` replays what the agent would do."""
    data = read_toml(path)
    source, base = str(path), Path(path).resolve().parent
    cloud = data.get("cloud")
    transports = tuple(t for t in TRANSPORTS if cloud.get(t)) if isinstance(cloud, dict) else None
    interval = data.get("probe_interval_s")
    if interval is not None:
        interval = float(_range(source, "probe_interval_s", interval, 0, low_open=True))
    agent = "repository" in data  # an agent.toml: what the agent runs when it says nothing
    links = _agent_links(data) if agent else data.get("links", {})
    named = {
        t: _profile("link", v, f"links.{t}", source, base)
        for t, v in links.items()
        if isinstance(v, str)
    }
    device = data.get("device", AGENT_DEFAULT_DEVICE if agent else None)
    if device is not None:
        device = _profile("device", device, "device", source, base)
    return FileSettings(transports, interval, named, device)


def load_policy_file(path: Path) -> PolicyConfig:
    """The ``[policy]`` and ``[models.*]`` of an agent.toml, or of a policy-only file."""
    data = read_toml(path)
    check_keys(data, _SCHEMA, str(path))
    return _policy(data, str(path))
