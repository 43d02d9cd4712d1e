"""MQTT naming and broker addresses both tiers agree on (no sockets here).

Topics follow DESIGN.md section 2.  Cloud nodes subscribe to a model's request
topic through the shared subscription group ``ferry`` so the broker spreads
requests over every node that hosts the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from shared.errors import ConfigError
from shared.mqtt.codec import topic_name_problem
from shared.redact import redact_url

PREFIX = "ferry/v1"
SHARE_GROUP = "ferry"
PLACEMENT_TOPIC = f"{PREFIX}/placement"
#: the active controller's retained status (its last will: offline)
CONTROLLER_TOPIC = f"{PREFIX}/controller/status"
#: the utilisation alerts in force (retained)
ALERTS_TOPIC = f"{PREFIX}/fleet/alerts"


#: A node publishes its status this often unless its status says otherwise (``interval_s``,
#: cloud.toml's mqtt.status_interval_s); one silent for SILENT_INTERVALS of them, and at
#: least SILENT_MIN_S, is gone: its last will is lost when it died while the broker was
#: down.  The controller's fleet view and the agents' MQTT transport both read it so.
DEFAULT_STATUS_INTERVAL_S = 5.0
MAX_STATUS_INTERVAL_S = 3600.0
SILENT_INTERVALS = 3
SILENT_MIN_S = 15.0


def status_interval_s(value: Any) -> float:
    """The interval a node's status names (``interval_s``), or the default where it
    names none or nonsense."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return min(float(value), MAX_STATUS_INTERVAL_S)
    return DEFAULT_STATUS_INTERVAL_S


def silence_limit_s(interval_s: float) -> float:
    """How long a node publishing every ``interval_s`` may be silent and still be live."""
    return max(SILENT_INTERVALS * interval_s, SILENT_MIN_S)


#: where every reply goes: a Response Topic outside it is refused (a node would
#: otherwise publish into a status, request or system topic a requester names)
REPLIES = f"{PREFIX}/replies/"


def request_topic(model: str, user: str | None = None) -> str:
    """A model's request topic; with ``user`` (a broker user name), that user's own
    one: a locked broker lets each user publish only under its name, so a node
    knows who sent a request there, which MQTT itself never tells a subscriber."""
    base = f"{PREFIX}/models/{model}/infer"
    return f"{base}/{user}" if user else base


def shared_request_topic(model: str) -> str:
    """The nodes' shared subscription to ``model``'s plain request topic."""
    return f"$share/{SHARE_GROUP}/{request_topic(model)}"


def shared_request_topics(model: str) -> tuple[str, str]:
    """The nodes' shared subscriptions for ``model``: its plain request topic and every
    user's own (a message matches one of the two, so it is dealt once)."""
    return shared_request_topic(model), f"$share/{SHARE_GROUP}/{request_topic(model, '+')}"


def _one_level(topic: str, head: str, tail: str) -> str | None:
    """The single topic level between ``head`` and ``tail``, or None."""
    if topic.startswith(head) and topic.endswith(tail) and len(topic) > len(head) + len(tail):
        name = topic[len(head) : -len(tail)]
        return name if "/" not in name else None
    return None


def model_from_topic(topic: str) -> str | None:
    """The model name in a request topic (plain or a user's own), or None."""
    parsed = parse_request_topic(topic)
    return parsed[0] if parsed is not None else None


def parse_request_topic(topic: str) -> tuple[str, str | None] | None:
    """(model, the user whose own request topic it is, or None), or None when
    ``topic`` is not a request topic."""
    head = f"{PREFIX}/models/"
    if not topic.startswith(head):
        return None
    parts = topic[len(head) :].split("/")
    if len(parts) == 2 and parts[1] == "infer" and parts[0]:
        return parts[0], None
    if len(parts) == 3 and parts[1] == "infer" and parts[0] and parts[2]:
        return parts[0], parts[2]
    return None


def reply_topic(client_id: str, username: str | None = None) -> str:
    """Where a client's replies go: under its broker user name when it has one, so a
    locked broker can give each device its own subtree (``replies/%u/#``) whatever
    client id a connection uses."""
    if username:
        return f"{PREFIX}/replies/{username}/{client_id}"
    return f"{PREFIX}/replies/{client_id}"


def reply_principal(topic: str | None) -> str:
    """Who sent a request, from its reply topic: the broker user of a logged-in client
    (``replies/<user>/<client id>``, which a locked broker lets only that user read),
    else "" (anonymous: the client id changes when an agent restarts, and a resend
    after the restart must still find its idempotency key)."""
    head = f"{PREFIX}/replies/"
    if topic and topic.startswith(head):
        user, sep, _ = topic[len(head) :].partition("/")
        if sep and user:
            return user
    return ""


def status_topic(node: str) -> str:
    return f"{PREFIX}/nodes/{node}/status"


def node_from_status_topic(topic: str) -> str | None:
    """The node name in a status topic, or None when the topic is not one."""
    return _one_level(topic, f"{PREFIX}/nodes/", "/status")


@dataclass(frozen=True)
class BrokerAddress:
    """Where a broker is and how to reach it (from ``mqtt://`` / ``mqtts://`` URLs)."""

    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)


def topic_level_problem(name: str) -> str | None:
    """Why ``name`` cannot be one level of a topic Ferry publishes or subscribes to (a
    node, a broker user, a client id), or None: a wildcard made the broker refuse the
    subscription and drop the client for good, and a '/' sent requests to a topic no
    node listens on, each waiting out its deadline."""
    return topic_name_problem(name) or ("it holds a '/'" if "/" in name else None)


def check_user_name(user: str | None, where: str) -> None:
    """A broker user name, as Ferry uses it: a level of its reply and request topics."""
    if user is None:
        return
    problem = topic_level_problem(user)
    if problem is not None:
        raise ConfigError(
            f"{where}: user name {user!r} cannot be used ({problem}; Ferry makes it a level "
            "of its MQTT topics: ferry/v1/replies/<user>/..., ferry/v1/models/<m>/infer/<user>)"
        )


def parse_broker_url(url: str) -> BrokerAddress:
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise ConfigError(f"broker URL {redact_url(url)!r}: {exc}") from None
    if parts.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
        raise ConfigError(f"broker URL {redact_url(url)!r}: scheme must be mqtt:// or mqtts://")
    tls = parts.scheme in ("mqtts", "ssl")
    if not parts.hostname:
        raise ConfigError(f"broker URL {redact_url(url)!r} has no host")
    try:
        port = parts.port or (8883 if tls else 1883)
    except ValueError:
        raise ConfigError(f"broker URL {redact_url(url)!r} has a bad port") from None
    user = unquote(parts.username) if parts.username else None
    check_user_name(user, f"broker URL {redact_url(url)!r}")
    return BrokerAddress(
        host=parts.hostname,
        port=port,
        tls=tls,
        username=user,
        password=unquote(parts.password) if parts.password else None,
    )
