from pathlib import Path

import pytest

from edge.config import load_agent_config, load_policy_file
from shared.errors import ConfigError
from tests.support import ROOT


def test_the_shipped_example_agent_config_parses():
    config = load_agent_config(ROOT / "examples" / "agent.toml")
    assert config.repository == (ROOT / "examples" / "repository").resolve()
    assert config.policy.models["orientation"].local_model == "orientation-int8"
    assert load_policy_file(ROOT / "examples" / "agent.toml").weights.energy_j == 0.05


@pytest.mark.parametrize(
    "text, message",
    [
        ('repository = "r"\nbogus = 1\n', "unknown key 'bogus'"),
        (
            'repository = "r"\n[policy]\ndeadline_ms = "soon"\n',
            "'policy.deadline_ms': expected a number",
        ),
        (
            'repository = "r"\n[policy.weights]\nlatency = 1\n',
            "unknown key 'policy.weights.latency'",
        ),
        ('repository = "r"\n[models.m]\nmode = "fast"\n', "'models.m.mode'"),
        ('repository = "r"\n[models.m]\nmode = "local"\n', "'models.m.local'"),
        (
            'repository = "r"\n[models.m]\nlocal = "a"\ntransports = ["carrier-pigeon"]\n',
            "'models.m.transports'",
        ),
        ('repository = "r"\n[models.m]\nlocal = "a"\ncascade_threshold = 2\n', "cascade_threshold"),
        ('repository = "r"\n[policy]\ndeadline_quantile = 1.5\n', "deadline_quantile"),
        ('repository = "r"\n[emulation]\nlocal_slowdown = 0.5\n', "local_slowdown"),
        ('repository = "r"\n[emulation]\nlocal_latency_ms = -1\n', "local_latency_ms"),
        ("[policy]\n", "'repository' is required"),
        ("repository =\n", "not valid TOML"),
    ],
)
def test_bad_agent_config_names_file_and_key(tmp_path: Path, text: str, message: str):
    path = tmp_path / "agent.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_agent_config(path)
    assert str(path) in info.value.message


async def test_a_bad_edit_is_ignored_and_a_good_one_swapped_in(tmp_path, edge_repos):
    import os

    from edge.agent import Agent
    from tests.edge.conftest import agent_toml

    path = agent_toml(tmp_path, edge_repos[1], models='[models.lin]\nlocal = "lin-local"\n')
    agent = Agent(load_agent_config(path))
    await agent.start()
    try:
        path.write_text(path.read_text() + "\nnot valid = = toml\n")
        os.utime(path, (1, 1))
        await agent._watch_config()
        assert agent.dataplane.policy.config.default_deadline_ms == 2000
        path.write_text(
            path.read_text()
            .replace("not valid = = toml", "")
            .replace("deadline_ms = 2000", "deadline_ms = 750")
        )
        os.utime(path, (2, 2))
        await agent._watch_config()
        assert agent.dataplane.policy.config.default_deadline_ms == 750
    finally:
        await agent.stop()
