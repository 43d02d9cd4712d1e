"""Topic names both tiers agree on, and their parsers."""

from __future__ import annotations

from shared.mqtt import (
    model_from_topic,
    node_from_status_topic,
    request_topic,
    status_topic,
)


def test_a_status_topic_gives_back_its_node_and_nothing_else_does() -> None:
    assert node_from_status_topic(status_topic("node-a")) == "node-a"
    assert node_from_status_topic("ferry/v1/nodes//status") is None
    assert node_from_status_topic("ferry/v1/nodes/a/b/status") is None
    assert node_from_status_topic("ferry/v1/placement") is None


def test_a_request_topic_gives_back_its_model() -> None:
    assert model_from_topic(request_topic("resnet")) == "resnet"
    assert model_from_topic("ferry/v1/models/a/b/infer") is None
