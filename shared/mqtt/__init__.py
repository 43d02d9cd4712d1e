"""MQTT for both tiers: topic names and broker addresses (:mod:`shared.mqtt.topics`),
the MQTT v5 packet codec and framer (sans-IO), and the asyncio client
(:mod:`shared.aio.mqtt`, imported only by the code that connects)."""

from shared.mqtt.topics import (
    ALERTS_TOPIC,
    CONTROLLER_TOPIC,
    PLACEMENT_TOPIC,
    PREFIX,
    REPLIES,
    SHARE_GROUP,
    BrokerAddress,
    model_from_topic,
    node_from_status_topic,
    parse_broker_url,
    parse_request_topic,
    reply_principal,
    reply_topic,
    request_topic,
    shared_request_topic,
    shared_request_topics,
    status_topic,
)

__all__ = [
    "ALERTS_TOPIC",
    "CONTROLLER_TOPIC",
    "PLACEMENT_TOPIC",
    "PREFIX",
    "REPLIES",
    "SHARE_GROUP",
    "BrokerAddress",
    "model_from_topic",
    "node_from_status_topic",
    "parse_broker_url",
    "parse_request_topic",
    "reply_principal",
    "reply_topic",
    "request_topic",
    "shared_request_topic",
    "shared_request_topics",
    "status_topic",
]
