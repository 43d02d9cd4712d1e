from pathlib import Path

import pytest

from cloud.config import load_config
from shared.errors import ConfigError


def test_command_line_overrides_the_file(tmp_path: Path):
    cfg = tmp_path / "cloud.toml"
    cfg.write_text(
        'repository = "repo"\nnode = "a"\n[http]\nport = 8001\n[mqtt]\nurl = "mqtt://u:p@broker:1999"\n'
    )
    config = load_config(cfg, {"http.port": 0, "node": None})
    assert config.repository == (tmp_path / "repo").resolve()
    assert config.node == "a" and config.http is not None and config.http.port == 0
    assert config.mqtt is not None and config.mqtt.broker.port == 1999
    assert config.mqtt.broker.username == "u" and config.mqtt.broker.password == "p"


MQTT = 'repository = "r"\n[mqtt]\nurl = "mqtt://h"\n[http]\nport = 0\n'


@pytest.mark.parametrize(
    "text, message",
    [
        ('repository = "r"\nbogus = 1\n', "unknown key 'bogus'"),
        ('repository = "r"\n[http]\nport = "80"\n', "'http.port': expected an integer"),
        ('repository = "r"\n[mqtt]\nurl = "http://x"\n', "mqtt://"),
        ('repository = "r"\n[http]\nenabled = false\n', "nothing would serve"),
        ("[http]\nport = 1\n", "'repository' is required"),
        ("repository = \n", "not valid TOML"),
        ('repository = "r"\ninline_run_us = -5\n', "'inline_run_us'"),
        ('repository = "r"\ninline_run_us = 1e9\n', "'inline_run_us'"),
        # a bound of 0 or less would refuse every request of a node that says it is ready
        ('repository = "r"\n[limits]\nmax_body_bytes = -1\n', "'limits.max_body_bytes'"),
        ('repository = "r"\n[limits]\nmax_elements = 0\n', "'limits.max_elements'"),
        ('repository = "r"\n[http]\nport = 70000\n', "'http.port': expected a port"),
        ('repository = "r"\nshutdown_grace_s = -1\n', "'shutdown_grace_s'"),
        # each of these was taken, and the node never joined its broker (or said why)
        ('repository = "r"\n[mqtt]\nurl = "mqtt://h"\nkeepalive_s = -1\n', "'mqtt.keepalive_s'"),
        ('repository = "r"\n[mqtt]\nurl = "mqtt://h"\nkeepalive_s = 70000\n', "to 65535"),
        (f'node = "n/#"\n{MQTT}', r"'node': 'n/#' cannot name a node \(it holds a wild"),
        (f'node = "n+1"\n{MQTT}', "'node': 'n\\+1' cannot name a node"),
        (f'node = "a/b"\n{MQTT}', r"cannot name a node \(it holds a '/'"),
        ('repository = "r"\n[http]\nshutdown_linger_s = -5\n', "'http.shutdown_linger_s'"),
        ('repository = "r"\n[http]\nshutdown_linger_s = nan\n', "'http.shutdown_linger_s'"),
        # (the [fleet] keys were named as [http] ones)
        (
            'repository = "r"\n[mqtt]\nurl = "mqtt://h"\n[fleet]\nfollow = true\nspeed = 0\n',
            "key 'fleet.speed': expected a number > 0",
        ),
        (
            'repository = "r"\n[mqtt]\nurl = "mqtt://h"\n[fleet]\nfollow = true\n'
            "handover_timeout_s = -1\n",
            "key 'fleet.handover_timeout_s'",
        ),
    ],
)
def test_bad_config_names_file_and_key(tmp_path: Path, text: str, message: str):
    cfg = tmp_path / "cloud.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(cfg, {})
    assert "cloud.toml" in info.value.message or "mqtt://" in message


@pytest.mark.parametrize("key", ["ca_file", "cert_file", "key_file", "tls_insecure"])
def test_tls_options_with_a_plain_mqtt_url_are_an_error_naming_the_key(tmp_path: Path, key):
    value = "true" if key == "tls_insecure" else '"/etc/ssl/x.pem"'
    cfg = tmp_path / "cloud.toml"
    cfg.write_text(f'repository = "r"\n[mqtt]\nurl = "mqtt://broker:1883"\n{key} = {value}\n')
    with pytest.raises(ConfigError, match=f"'mqtt.{key}'.*mqtts://"):
        load_config(cfg, {})
    cfg.write_text(
        f'repository = "r"\n[mqtt]\nurl = "mqtts://broker:8883"\n{key} = {value}\n'
        + ('cert_file = "/etc/ssl/c.pem"\n' if key == "key_file" else "")
    )
    assert load_config(cfg, {}).mqtt is not None


def test_node_limits_and_every_codec_limit_are_read_from_the_limits_table(tmp_path: Path):
    from dataclasses import fields

    from shared.tensors import Limits

    codec = {f.name: 1000 + i for i, f in enumerate(fields(Limits))}
    cfg = tmp_path / "cloud.toml"
    cfg.write_text(
        'repository = "r"\nstrict_readiness = false\nidempotency_ttl_s = 30\n[limits]\n'
        + "".join(f"{k} = {v}\n" for k, v in codec.items())
        + "max_queue_size = 7\nmax_inflight_mqtt = 9\n"
    )
    config = load_config(cfg, {})
    assert {k: getattr(config.limits, k) for k in codec} == codec
    assert (config.max_queue_size, config.max_inflight_mqtt) == (7, 9)
    assert config.strict_readiness is False and config.idempotency_ttl_s == 30


def test_defaults_bound_queues_and_mqtt_in_flight(tmp_path: Path):
    config = load_config(None, {"repository": str(tmp_path)})
    assert config.max_queue_size == 1024 and config.max_inflight_mqtt == 1024
    assert config.strict_readiness is True and config.idempotency_ttl_s == 600


def test_negative_node_limit_is_an_error(tmp_path: Path):
    cfg = tmp_path / "cloud.toml"
    cfg.write_text('repository = "r"\n[limits]\nmax_queue_size = -1\n')
    with pytest.raises(ConfigError, match=r"'limits\.max_queue_size'"):
        load_config(cfg, {})


def test_relative_secret_and_token_paths_are_read_from_the_config_files_folder(
    tmp_path: Path, monkeypatch
):
    folder = tmp_path / "etc"
    folder.mkdir()
    (folder / "pw.txt").write_text("secret\n")
    cfg = folder / "cloud.toml"
    cfg.write_text(
        'repository = "r"\n[http]\ntokens_file = "tok.txt"\n'
        '[mqtt]\nurl = "mqtt://127.0.0.1:1883"\npassword_file = "pw.txt"\nusername = "u"\n'
    )
    monkeypatch.chdir(tmp_path)  # elsewhere: the file's folder decides, as for repository
    config = load_config(cfg, {})
    assert config.http is not None and config.http.tokens_file == folder / "tok.txt"
    assert config.mqtt is not None and config.mqtt.broker.password == "secret"


def test_a_node_name_is_a_topic_level_only_where_there_is_a_broker(tmp_path: Path):
    cfg = tmp_path / "cloud.toml"
    cfg.write_text('node = "rack/3"\nrepository = "r"\n[http]\nport = 0\n')
    assert load_config(cfg, {}).node == "rack/3"  # an HTTP-only node never names a topic
    cfg.write_text('repository = "r"\nshutdown_grace_s = inf\n')
    assert load_config(cfg, {}).shutdown_grace_s == float("inf")  # wait as long as it takes


def test_an_empty_model_list_loads_none_and_a_star_loads_every_model(tmp_path: Path):
    """Triton's explicit mode: a node that starts empty and loads through the API (an
    empty list had meant every model, and a big repository ran the node out of memory)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'repository = "{tmp_path}"\nmodels = []\n')
    assert load_config(cfg, {}).models == ()
    assert load_config(cfg, {"models": ["*"]}).models is None
    assert load_config(None, {"repository": str(tmp_path)}).models is None
