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


@pytest.mark.parametrize(
    "text, message",
    [
        ('repository = "r"\nbogus = 1\n', "unknown key 'bogus'"),
        ('repository = "r"\n[http]\nport = "80"\n', "'http.port': expected an integer"),
        ('repository = "r"\n[mqtt]\nurl = "http://x"\n', "mqtt://"),
        ('repository = "r"\n[http]\nenabled = false\n', "nothing would serve"),
        ("[http]\nport = 1\n", "'repository' is required"),
        ("repository = \n", "not valid TOML"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path: Path, text: str, message: str):
    cfg = tmp_path / "cloud.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(cfg, {})
    assert "cloud.toml" in info.value.message or "mqtt://" in message
