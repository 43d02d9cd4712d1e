"""Topic names both tiers agree on, and their parsers."""

from __future__ import annotations

import pytest

from shared.errors import ConfigError
from shared.mqtt import (
    model_from_topic,
    node_from_status_topic,
    parse_broker_url,
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


@pytest.mark.parametrize("user", ["a%2Bb", "a%23b", "a%2Fb", "a%00b"])
def test_a_broker_user_name_that_cannot_be_a_topic_level_is_refused_at_once(user):
    # It becomes a level of Ferry's reply and request topics: a wildcard made the broker
    # drop the client for good, a '/' sent every request where no node listens.
    with pytest.raises(ConfigError, match="cannot be used"):
        parse_broker_url(f"mqtt://{user}:pw@127.0.0.1:1883")


def test_a_nodes_user_name_and_client_id_are_checked_as_topic_levels(tmp_path):
    from cloud.config import load_config

    for key, value in (("username", "a+b"), ("client_id", "n/1")):
        path = tmp_path / "cloud.toml"
        path.write_text(
            f'repository = "{tmp_path}"\n[mqtt]\nurl = "mqtt://127.0.0.1:1883"\n{key} = "{value}"\n'
        )
        with pytest.raises(ConfigError, match=f"key 'mqtt.{key}'"):
            load_config(path, {})
