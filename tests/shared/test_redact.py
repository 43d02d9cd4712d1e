"""A URL's password never shows: config errors, reprs, endpoint messages."""

from __future__ import annotations

import pytest

from edge.config import CloudEndpoints, load_agent_config
from shared.errors import ConfigError
from shared.mqtt import parse_broker_url
from shared.redact import redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("mqtt://node:s3cret@127.0.0.1:1883", "mqtt://node:***@127.0.0.1:1883"),
        ("http://u:p@ss@host:8000/v2?x=1", "http://u:***@host:8000/v2?x=1"),
        ("mqtts://u:p%40x@[::1]:8883", "mqtts://u:***@[::1]:8883"),
        ("mqtt://user@host", "mqtt://user@host"),
        # generated passwords hold what ends an authority early: hidden all the same
        ("mqtt://user:pa/ss@host:1883", "mqtt://user:***@host:1883"),
        ("mqtt://u:p?x#y@h", "mqtt://u:***@h"),
        ("mqtt://host:1883", "mqtt://host:1883"),
        ("http://host/a:b@c", "http://host/a:b@c"),
    ],
)
def test_a_urls_password_is_hidden_and_the_rest_kept(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "mqtt://node:s3cret@127.0.0.1:notaport",
        "http://node:s3cret@127.0.0.1:1883",
        "mqtt://node:s3cret@:1883",
        "mqtt://node:s3cret@[::1:1883",
        "mqtt://node:s3c/ret@127.0.0.1:1883",
    ],
)
def test_a_bad_broker_url_is_refused_without_its_password(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_broker_url(url)
    shown = str(caught.value)
    assert "s3cret" not in shown and "s3c/ret" not in shown and "node:***@" in shown


def test_the_agents_endpoints_repr_shows_no_password(tmp_path) -> None:
    endpoints = CloudEndpoints(mqtt_url="mqtt://dev:s3cret@h:1883", http_url="http://a:pw@h:1")
    shown = repr(endpoints)
    assert "s3cret" not in shown and ":pw@" not in shown
    assert "mqtt://dev:***@h:1883" in shown and "mqtt_keepalive_s=30" in shown
    bad = tmp_path / "agent.toml"
    bad.write_text('[cloud]\nhttp = "ftp://a:topsecret@h:1"\n')
    with pytest.raises(ConfigError) as caught:
        load_agent_config(bad)
    assert "topsecret" not in str(caught.value)


def test_a_nodes_tls_keys_on_a_plain_url_are_refused_without_its_password(tmp_path) -> None:
    from cloud.config import load_config

    path = tmp_path / "cloud.toml"
    path.write_text(
        f'repository = "{tmp_path}"\n[mqtt]\nurl = "mqtt://node:s3cret@127.0.0.1:1883"\n'
        'ca_file = "ca.pem"\n'
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path, {})
    assert "s3cret" not in str(caught.value) and "ca_file" in str(caught.value)
