"""Cloud node configuration: ``cloud.toml`` plus command-line overrides.

Built once in ``main()`` and passed down frozen; nothing reads the
environment later.  Unknown keys are errors that name the file and the key,
as in the model repository.

``[limits]`` holds the codec's bounds (every field of
:class:`shared.tensors.Limits`) and the node's own: ``max_queue_size``, the
queue bound of every model that sets none (0: unbounded), and
``max_inflight_mqtt``, how many MQTT requests may be received but not yet
answered before new ones get an "overloaded" reply, and ``max_inflight_bytes``,
the bytes of such requests over HTTP and MQTT together (0: no bound).
``[http]`` bounds how long a connection may dawdle (``header_timeout_s``,
``body_timeout_s``, ``idle_timeout_s``) and how many may be open
(``max_connections``).  TLS options
(``mqtt.ca_file`` ...) need an ``mqtts://`` URL: with ``mqtt://`` they
are an error rather than silently ignored.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from shared.configcheck import NUMBER, check_keys, read_toml
from shared.errors import ConfigError
from shared.mqtt import BrokerAddress, parse_broker_url
from shared.mqtt.topics import check_user_name, topic_level_problem
from shared.redact import redact_url
from shared.tensors import Limits

#: a node's name, in UTF-8 bytes (a topic level and a Prometheus label: a host name's
#: length is plenty)
MAX_NODE_NAME_BYTES = 255


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    tokens_file: Path | None = None
    open_metrics: bool = False
    #: a connection that sends part of a request header and stops is closed after this
    header_timeout_s: float = 10.0
    #: a request body not fully received in this long gets 504 and frees its budget
    body_timeout_s: float = 60.0
    #: a kept-alive connection with no request for this long is closed
    idle_timeout_s: float = 75.0
    #: open connections before new ones get 503 and are closed (0: from the descriptor limit)
    max_connections: int = 0
    #: on SIGTERM, kept-alive connections stay this long (within the grace) so a request
    #: already on its way gets 503 + Connection: close instead of a reset
    shutdown_linger_s: float = 2.0


@dataclass(frozen=True)
class MqttConfig:
    broker: BrokerAddress
    client_id: str | None = None
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    tls_insecure: bool = False
    status_interval_s: float = 5.0
    # The broker drops a silent client after 1.5x this and stops giving it requests:
    # a node that stalled while connected (a paused VM, a stopped process) kept its
    # share of the shared subscription for 45 s at 30; a data-centre link has no NAT
    # idle timeout to stay under.
    keepalive_s: int = 10


#: queue bound of a model that sets no ``dynamic_batching.max_queue_size``
DEFAULT_MAX_QUEUE_SIZE = 1024
#: MQTT requests received but not yet answered, before "overloaded" replies
DEFAULT_MAX_INFLIGHT_MQTT = 1024
#: bytes of requests received and not yet answered, HTTP and MQTT together
DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20
#: about what a worker thread's hand-off and wake-up cost here (docs/performance.md)
DEFAULT_INLINE_RUN_US = 100.0


@dataclass(frozen=True)
class CloudConfig:
    repository: Path
    node: str = field(default_factory=socket.gethostname)
    models: tuple[str, ...] | None = None  # None: every model in the repository
    http: HttpConfig | None = field(default_factory=HttpConfig)
    mqtt: MqttConfig | None = None
    limits: Limits = field(default_factory=Limits)
    shutdown_grace_s: float = 30.0
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE
    max_inflight_mqtt: int = DEFAULT_MAX_INFLIGHT_MQTT
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    #: Triton's --strict-readiness: not ready while a requested model failed to load
    strict_readiness: bool = True
    idempotency_ttl_s: float = 600.0
    idempotency_max_entries: int = 4096
    idempotency_max_bytes: int = 64 << 20
    #: a lone request on an idle model whose recent runs took under this runs on the
    #: event loop instead of a worker thread (shared.runtimes.inline); 0: never
    inline_run_us: float = DEFAULT_INLINE_RUN_US
    fleet: FleetConfig | None = None  # set: follow the controller's placement


@dataclass(frozen=True)
class FleetConfig:
    """``[fleet]``: a node that follows the controller (``serve --controller``).

    ``memory_bytes`` is what the controller may fill with models on this node
    (0: the memory available when the node starts); ``speed`` is the node's
    speed relative to the machine the tuning profiles were measured on;
    ``turns`` runs one batch at a time, the models taking turns
    (:mod:`cloud.workers`): the schedule the placement is planned for.
    """

    memory_bytes: int = 0
    speed: float = 1.0
    handover_timeout_s: float = 30.0
    turns: bool = True  # one batch at a time on the node, as the placement plans


_NODE_LIMITS = {"max_queue_size": int, "max_inflight_mqtt": int, "max_inflight_bytes": int}
_TLS_KEYS = ("ca_file", "cert_file", "key_file", "tls_insecure")


_SCHEMA: dict[str, Any] = {
    "repository": str,
    "node": str,
    "models": list,
    "shutdown_grace_s": NUMBER,
    "strict_readiness": bool,
    "idempotency_ttl_s": NUMBER,
    "idempotency_max_entries": int,
    "idempotency_max_bytes": int,
    "inline_run_us": NUMBER,
    "fleet": {
        "follow": bool,
        "memory_bytes": int,
        "speed": NUMBER,
        "handover_timeout_s": NUMBER,
        "turns": bool,
    },
    "http": {
        "host": str,
        "port": int,
        "tokens_file": str,
        "open_metrics": bool,
        "enabled": bool,
        "header_timeout_s": NUMBER,
        "body_timeout_s": NUMBER,
        "idle_timeout_s": NUMBER,
        "max_connections": int,
        "shutdown_linger_s": NUMBER,
    },
    "mqtt": {
        "url": str,
        "username": str,
        "password_file": str,
        "client_id": str,
        "ca_file": str,
        "cert_file": str,
        "key_file": str,
        "tls_insecure": bool,
        "status_interval_s": NUMBER,
        "keepalive_s": int,
    },
    # every codec bound of shared.tensors.Limits, plus the node's own
    "limits": {**{f.name: int for f in fields(Limits)}, **_NODE_LIMITS},
}


def _read_secret(path: str, source: str, key: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{source}: key {key!r}: cannot read {path}: {exc.strerror}") from None


def _non_negative(value: int, source: str, key: str) -> int:
    if value < 0:
        raise ConfigError(f"{source}: key {key!r}: expected an integer >= 0, got {value}")
    return value


def _grace(value: float, source: str, key: str = "shutdown_grace_s") -> float:
    value = float(value)
    if not value >= 0:  # also NaN (inf: wait as long as it takes)
        raise ConfigError(f"{source}: key '{key}': expected a number >= 0, got {value}")
    return value


def _keepalive(value: int, source: str) -> int:
    # (CONNECT carries it in two bytes: out of range, every connection attempt failed
    # with a struct error and the node never joined the broker)
    if not 0 <= value <= 65535:
        raise ConfigError(
            f"{source}: key 'mqtt.keepalive_s': expected seconds from 0 (none) to 65535, "
            f"got {value}"
        )
    return value


def _port(value: int, source: str, key: str) -> int:
    if not 0 <= value <= 65535:
        raise ConfigError(f"{source}: key {key!r}: expected a port from 0 to 65535, got {value}")
    return value


def _positive(
    table: dict[str, Any], key: str, default: float, source: str, section: str = "http"
) -> float:
    value = float(table.get(key, default))
    if not value > 0:
        raise ConfigError(f"{source}: key '{section}.{key}': expected a number > 0, got {value}")
    return value


def _node_name(value: object, source: str) -> str:
    """The node's name is one level of its status topic and part of its MQTT client id:
    a wildcard or a '/' there made the broker refuse every connection, and the node
    retried for good without saying why."""
    if not isinstance(value, str):
        raise ConfigError(f"{source}: key 'node': expected a string, got {value!r}")
    problem = topic_level_problem(value)
    if problem is None and len(value.encode("utf-8")) > MAX_NODE_NAME_BYTES:
        problem = f"it is longer than {MAX_NODE_NAME_BYTES} bytes"
    if problem is not None:
        raise ConfigError(
            f"{source}: key 'node': {value!r} cannot name a node ({problem}; it becomes a "
            "level of the MQTT topic ferry/v1/nodes/<node>/status)"
        )
    return value


def parse_mqtt_section(mqtt_data: dict[str, Any], source: str, base: Path) -> MqttConfig | None:
    """The ``[mqtt]`` table (None without a ``url``): a node's, and the controller's and
    ``ferry-cloud fleet``'s (``--config``), so all three reach a locked broker alike;
    relative files are read from ``base``."""
    if not mqtt_data.get("url"):
        return None
    broker = parse_broker_url(mqtt_data["url"])
    if mqtt_data.get("username"):
        check_user_name(mqtt_data["username"], f"{source}: key 'mqtt.username'")
        broker = replace(broker, username=mqtt_data["username"])
    client_id = mqtt_data.get("client_id")
    if client_id and (problem := topic_level_problem(client_id)) is not None:
        # (a node's forwarder takes its replies on ferry/v1/replies/[user/]<client_id>-fwd)
        raise ConfigError(
            f"{source}: key 'mqtt.client_id': {client_id!r} cannot be used ({problem}; it "
            "becomes a level of the node's MQTT reply topic)"
        )
    if mqtt_data.get("password_file"):
        secret = _read_secret(str(base / mqtt_data["password_file"]), source, "mqtt.password_file")
        broker = replace(broker, password=secret)

    def opt_path(key: str) -> Path | None:
        return (base / mqtt_data[key]) if mqtt_data.get(key) else None

    if not broker.tls:
        for key in _TLS_KEYS:
            if mqtt_data.get(key):
                raise ConfigError(
                    f"{source}: key 'mqtt.{key}': TLS options need an mqtts:// broker URL, "
                    f"but mqtt.url is {redact_url(mqtt_data['url'])!r} (plain TCP)"
                )
    if mqtt_data.get("key_file") and not mqtt_data.get("cert_file"):
        raise ConfigError(f"{source}: key 'mqtt.key_file': needs mqtt.cert_file as well")
    interval = float(mqtt_data.get("status_interval_s", 5.0))
    if not 0 < interval <= 3600:  # (also NaN) 0 spun the status loop; peers time it
        raise ConfigError(
            f"{source}: key 'mqtt.status_interval_s': expected a value > 0 and <= 3600, "
            f"got {interval}"
        )
    return MqttConfig(
        broker=broker,
        client_id=mqtt_data.get("client_id") or None,
        ca_file=opt_path("ca_file"),
        cert_file=opt_path("cert_file"),
        key_file=opt_path("key_file"),
        tls_insecure=mqtt_data.get("tls_insecure", False),
        status_interval_s=interval,
        keepalive_s=_keepalive(mqtt_data.get("keepalive_s", MqttConfig.keepalive_s), source),
    )


def load_config(path: Path | None, overrides: dict[str, Any]) -> CloudConfig:
    """Read ``cloud.toml`` (optional) and apply command-line ``overrides``.

    Overrides use the same dotted keys as the file: ``repository``,
    ``http.port``, ``mqtt.url`` ...; a value of None leaves the file's value.
    """
    data: dict[str, Any] = {}
    source = str(path) if path else "command line"
    if path is not None:
        data = read_toml(path)
        check_keys(data, _SCHEMA, source)
    for dotted, value in overrides.items():
        if value is None:
            continue
        table = data
        *parents, leaf = dotted.split(".")
        for parent in parents:
            table = table.setdefault(parent, {})
        table[leaf] = value
    if "repository" not in data:
        raise ConfigError(f"{source}: key 'repository' is required (or pass --repository)")
    base = Path(path).parent if path else Path.cwd()
    repository = (
        (base / data["repository"]).resolve() if path else Path(data["repository"]).resolve()
    )

    http_data = data.get("http", {})
    http = None
    if http_data.get("enabled", True):
        tokens = http_data.get("tokens_file")
        http = HttpConfig(
            host=http_data.get("host", "127.0.0.1"),
            port=_port(http_data.get("port", 8000), source, "http.port"),
            tokens_file=(base / tokens) if tokens else None,
            open_metrics=http_data.get("open_metrics", False),
            header_timeout_s=_positive(http_data, "header_timeout_s", 10.0, source),
            body_timeout_s=_positive(http_data, "body_timeout_s", 60.0, source),
            idle_timeout_s=_positive(http_data, "idle_timeout_s", 75.0, source),
            shutdown_linger_s=_grace(
                http_data.get("shutdown_linger_s", 2.0), source, "http.shutdown_linger_s"
            ),
            max_connections=_non_negative(
                http_data.get("max_connections", 0), source, "http.max_connections"
            ),
        )
    mqtt = parse_mqtt_section(data.get("mqtt", {}), source, base)
    limits_data = data.get("limits", {})
    node_limits = {}
    for key in _NODE_LIMITS:
        if key in limits_data:
            node_limits[key] = _non_negative(limits_data[key], source, f"limits.{key}")
    codec_limits = {}
    for key, value in limits_data.items():
        if key not in _NODE_LIMITS:
            if value < 1:  # a 0 or negative bound would refuse every request
                raise ConfigError(
                    f"{source}: key 'limits.{key}': expected an integer >= 1, got {value}"
                )
            codec_limits[key] = value
    limits = Limits(**codec_limits)
    ttl = float(data.get("idempotency_ttl_s", 600.0))
    if not ttl >= 0:  # also NaN
        raise ConfigError(f"{source}: key 'idempotency_ttl_s': expected a number >= 0, got {ttl}")
    inline_us = float(data.get("inline_run_us", DEFAULT_INLINE_RUN_US))
    if not 0 <= inline_us <= 10_000:
        raise ConfigError(
            f"{source}: key 'inline_run_us': expected a number of microseconds from 0 to "
            f"10000, got {inline_us}"
        )
    models = data.get("models")
    if models is not None and not all(isinstance(m, str) and m for m in models):
        raise ConfigError(f"{source}: key 'models': expected a list of model names")
    if models is not None and "*" in models:
        models = None  # (an empty list loads none: Triton's explicit mode)
    config = CloudConfig(
        repository=repository,
        node=data.get("node") or socket.gethostname(),
        models=tuple(models) if models is not None else None,
        http=http,
        mqtt=mqtt,
        limits=limits,
        shutdown_grace_s=_grace(data.get("shutdown_grace_s", 30.0), source),
        max_queue_size=node_limits.get("max_queue_size", DEFAULT_MAX_QUEUE_SIZE),
        max_inflight_mqtt=node_limits.get("max_inflight_mqtt", DEFAULT_MAX_INFLIGHT_MQTT),
        max_inflight_bytes=node_limits.get("max_inflight_bytes", DEFAULT_MAX_INFLIGHT_BYTES),
        strict_readiness=data.get("strict_readiness", True),
        idempotency_ttl_s=ttl,
        inline_run_us=inline_us,
        idempotency_max_bytes=_non_negative(
            data.get("idempotency_max_bytes", 64 << 20), source, "idempotency_max_bytes"
        ),
        idempotency_max_entries=max(
            1,
            _non_negative(
                data.get("idempotency_max_entries", 4096), source, "idempotency_max_entries"
            ),
        ),
    )
    if config.mqtt is not None:  # (a topic level only where there is a broker)
        _node_name(config.node, source)
    if config.http is None and config.mqtt is None:
        raise ConfigError(f"{source}: neither HTTP nor MQTT is enabled; nothing would serve")
    fleet_data = data.get("fleet", {})
    if fleet_data.get("follow", False):
        if config.mqtt is None:
            raise ConfigError(
                f"{source}: key 'fleet.follow': following the controller needs a broker "
                "(mqtt.url or --mqtt)"
            )
        config = replace(
            config,
            fleet=FleetConfig(
                memory_bytes=_non_negative(
                    fleet_data.get("memory_bytes", 0), source, "fleet.memory_bytes"
                ),
                speed=_positive(fleet_data, "speed", 1.0, source, "fleet"),
                handover_timeout_s=_positive(
                    fleet_data, "handover_timeout_s", 30.0, source, "fleet"
                ),
                turns=bool(fleet_data.get("turns", True)),
            ),
        )
    return config
